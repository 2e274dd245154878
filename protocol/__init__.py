"""What crosses a process boundary inside pdserve, torch-free so that the router, both workers and
kvtransfer can import it: the router <-> worker messages (`messages`), the decode workers' token stream
to the router (`token_stream`), and how addresses are written (`addresses`). The public API is
proto/pdserve/v1/pdserve.proto; kvtransfer's wire format is kvtransfer/wire.py."""
