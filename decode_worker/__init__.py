"""Decode worker (Ray actor): reserves KV blocks, installs transferred KV, runs continuous batching
and streams tokens. Imports `engine` and `kvtransfer`, never `prefill_worker`. (Issue #4.)"""
