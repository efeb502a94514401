"""The front end's engine-side work: requests in, text out.

Validating and tokenizing requests, and turning EngineCore outputs into text (incremental
detokenization, stop strings, n > 1).
"""
