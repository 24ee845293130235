"""Suffix decoding (Oliaro et al., arXiv 2411.04975) on Snowflake's arctic-inference:
a suffix tree of each request's prompt and one over the outputs of earlier requests
(up to suffix_decoding_max_cached_requests of them), matched against the request's
last tokens; the draft follows the likeliest branch while its estimated probability
stays above suffix_decoding_min_token_prob, and its length adapts to the match
(at most max_spec_factor x the matched length, and the draft slots)."""

import numpy as np
from arctic_inference.suffix_decoding import SuffixDecodingCache

from flagstop.executor.input_batch import InputBatch
from flagstop.executor.speculative.config import SpeculativeConfig
from flagstop.executor.speculative.proposer import NoProposer


class SuffixProposer(NoProposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.cache = self._new_cache()
        self.req_of_row: dict[int, str] = {}

    def _new_cache(self) -> SuffixDecodingCache:
        c = self.config
        return SuffixDecodingCache(c.suffix_decoding_max_tree_depth,
                                   c.suffix_decoding_max_cached_requests)  # fmt: skip

    def add(self, req_id: str, row: int, batch: InputBatch) -> None:
        if req_id in self.cache.active_requests:  # resumed: its tree starts over
            self.cache.stop_request(req_id)
        tokens = batch.token_ids[row, : batch.num_tokens[row]].astype(np.int32)
        self.cache.start_request(req_id, tokens)
        self.req_of_row[row] = req_id

    def remove(self, req_id: str) -> None:
        if req_id in self.cache.active_requests:
            self.cache.stop_request(req_id)

    def propose(self, batch, rows, slots):
        c, depth, drafts = self.config, self.config.suffix_decoding_max_tree_depth, []
        for row, k in zip(rows.tolist(), slots.tolist(), strict=True):
            n = int(batch.num_tokens[row])
            context = batch.token_ids[row, max(0, n - depth) : n].astype(np.int32)
            draft = self.cache.speculate(
                self.req_of_row[row], context, max_spec_tokens=int(k),
                max_spec_factor=c.suffix_decoding_max_spec_factor,
                min_token_prob=c.suffix_decoding_min_token_prob,
            )  # fmt: skip
            drafts.append(np.asarray(draft.token_ids[:k], np.int64))
        return drafts, None

    def verified(self, batch, rows, num_known, num_sampled) -> None:
        for row, start, n in zip(rows.tolist(), num_known.tolist(), num_sampled.tolist(),
                                 strict=True):  # fmt: skip
            req_id = self.req_of_row.get(row)
            if req_id is not None and req_id in self.cache.active_requests:
                tokens = batch.token_ids[row, start : start + n].astype(np.int32)
                self.cache.add_active_response(req_id, tokens)

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.req_of_row = {}
