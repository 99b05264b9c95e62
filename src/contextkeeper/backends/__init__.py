"""Client facades: what ``keeper.wrap(client)`` returns for the openai SDK (:mod:`.openai`), a local transformers
model (:mod:`.transformers`) and plain callables (:mod:`.callable`). Each registers its wrapper in
:mod:`.registry` as it loads; the call itself runs in :mod:`contextkeeper.calls`.
"""

from . import callable as _callable  # noqa: F401  (registration order: the order wrappers are tried)
from . import openai as _openai  # noqa: F401
from . import transformers as _transformers  # noqa: F401
from .registry import register_wrapper, wrap

__all__ = ["register_wrapper", "wrap"]
