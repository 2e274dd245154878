"""The front door: gRPC and OpenAI-compatible HTTP servers, validation, tokenization, routing, pool
management and metrics. Never imports torch (tests/test_layering.py checks). (Issues #4-#6.)"""
