"""Rendering a chat template message by message, with each message's output remembered.

Most chat templates are a preamble, one ``{% for message in messages %}`` loop and a closing generation
prompt. When the loop body can only see its own message, its neighbours at fixed offsets, its position and
whether it is last — and nothing carries over from one iteration to the next — the rendered prompt is the
preamble, then each message's body output, then the ending; a body output can be remembered and reused as long
as those inputs are the same objects. The parts:

- :mod:`.split` proves that shape from the template's syntax tree, as a sequence of named checks
  (:data:`~.split.CHECKS`); :func:`try_split` says which check refused a template, :func:`split_template`
  returns None for it (it is then rendered whole);
- :mod:`.plan` decides, as pure functions of the previous call's state and this call's inputs, which body
  outputs a call takes whole from the previous call and which it looks up or renders;
- :mod:`.renderer` carries the plan out and keeps the per-call state;
- :mod:`.syntax`, :mod:`.guards` and :mod:`.scan` are the syntax-tree questions, the position comparisons
  taken out of the body, and the head's backward scan stopped early.

The equivalence is checked against whole renders over all the templates the tests fetch.
"""

from __future__ import annotations

from .guards import Guard
from .plan import Previous, RenderPlan, plan_render
from .renderer import IncrementalRenderer, LoopState
from .split import CHECKS, Refusal, SplitTemplate, split_template, try_split

__all__ = [
    "CHECKS",
    "Guard",
    "IncrementalRenderer",
    "LoopState",
    "Previous",
    "Refusal",
    "RenderPlan",
    "SplitTemplate",
    "plan_render",
    "split_template",
    "try_split",
]
