"""Prefill worker (Ray actor): batches and chunks prompts, runs prefill, samples the first token and
hands the KV to `kvtransfer`. Imports `engine` and `kvtransfer`, never `decode_worker`. (Issue
#4.)"""
