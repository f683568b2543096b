"""One generation request as the scheduler sees it: its tokens, how many are in the caches, and its resources."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from qwen35.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued, holds nothing
    RUNNING = "running"      # holds a state slot and its KV blocks; prefilling or decoding
    FINISHED = "finished"    # stop token, stop string or max_tokens; resources returned
    ABORTED = "aborted"      # cancelled by the caller; resources returned


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0                 # tokens already written into this request's KV blocks / DeltaNet state
    state_slot: int | None = None
    block_ids: list[int] = field(default_factory=list)  # all blocks reserved at admission
    finish_reason: str | None = None
    # prefix cache: the entry whose first num_shared_blocks blocks this request reads, and where (in prompt
    # tokens) its prefill pauses to be snapshotted (None: not to be cached)
    cache_entry: object = None
    num_shared_blocks: int = 0
    snapshot_at: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_cached_tokens(self) -> int:
        """Most tokens this request can ever feed the model: the last sampled token is never fed back."""
        return len(self.prompt_ids) + self.params.max_tokens - 1

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]
