"""Running the target: the prefill, the one plain decode loop, and the stream loop every decoder's tokens go through
(EOS, stop strings, max_tokens, detokenisation, statistics)."""
