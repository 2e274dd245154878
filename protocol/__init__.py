"""What crosses a process boundary inside pdserve, torch-free so that the router, both workers and
kvtransfer can import it: the router's requests to the workers (`requests`) and their replies
(`messages`), the decode workers' token stream to the router (`token_stream`), how addresses are
written (`addresses`), and the chained hashes that name KV blocks in the engines' prefix caches and
in the router's index of them (`block_hash`). The public API is proto/pdserve/v1/pdserve.proto;
kvtransfer's wire format is kvtransfer/wire.py."""
