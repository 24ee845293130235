"""Speculative decoding in the executor: the proposers that fill the scheduler's
draft slots (ngram, draft_model, suffix) and the config that picks one."""
