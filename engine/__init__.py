"""The model engine: a Llama-family transformer, its weights and tokenizer, sampling, and the paged KV
cache. Workers import it; the router must not (it pulls in torch)."""
