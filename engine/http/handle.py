"""`Head`: the head worker as the routes see it. `workers/head.HeadWorker` builds and serves the
app and has these attributes; the routes depend on this declaration, not on the composition root
that imports them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the engine's modules bring torch: imported when the model loads, after the port is up
    from ..config import HeadConfig
    from ..gguf_file import GGUFFile
    from ..metrics import Metrics
    from ..model.rank import RankHead
    from ..pipeline import Pipeline
    from ..serving.runtime import Engine
    from ..status import StatusDocument
    from ..text.chat import ChatTemplate
    from ..text.tokenizer import Tokenizer
    from ..workers.idle_sleep import IdleSleep
    from .drain import Drain


class Head(Protocol):
    """What the routes read; the model's parts are None until it has loaded (`ready`)."""

    cfg: HeadConfig
    status: StatusDocument
    metrics: Metrics
    drain: Drain
    model_name: str | None
    pooling: str | None  # embedding pooling, resolved at load
    rank_head: RankHead | None  # pooling rank on a reranker: what scores /rerank's pairs
    rank_refusal: str | None  # pooling rank on another model: why /rerank answers 501
    created: int  # /v1/models' `created`
    gguf: GGUFFile | None
    tok: Tokenizer | None
    chat_template: ChatTemplate | None
    fim_tokens: dict[str, int | None]  # /infill's pre/suf/mid/rep/sep token ids
    engine: Engine | None
    pipeline: Pipeline | None
    idle: IdleSleep | None  # --sleep-idle-seconds, once the model has loaded (http/wake.py)

    @property
    def ready(self) -> bool: ...
