"""Speculative decoding: draft proposers, verification (greedy and rejection sampling) and the
rollback of rejected draft tokens from a request's KV state (docs/speculative.md)."""
