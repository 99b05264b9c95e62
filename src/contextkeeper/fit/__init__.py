"""The pure fit core: the reserve-then-budget pipeline run over a conversation (:mod:`.engine`), the per-conversation
state it keeps (:mod:`.session`), the budget (:mod:`.budget`) and what a fit returns (:mod:`.report`). Nothing here
does I/O."""

from .budget import Reserve
from .report import Fit, FitReport

__all__ = ["Fit", "FitReport", "Reserve"]
