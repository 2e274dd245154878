"""The model engine: a Llama-family transformer, its weights and tokenizer, sampling, and the paged
KV cache. Workers import it; the router imports only its torch-free modules (tokenizer, detokenizer,
sampling_params, worker_messages, block_manager, telemetry, config: tests/test_layering.py)."""
