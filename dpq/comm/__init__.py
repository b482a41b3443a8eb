"""Communicators: the protocol and its canonical order (``comm_base``), the registry and the
plan's choice (``communicators``), the exchange's second stream (``comm_streams``), NCCL
handles (``nccl_lifecycle``), the ``torch.distributed`` communicator (``process_group``).
The NCCL and peer-copy kinds live at ``dpq/nccl_comm.py`` and ``dpq/fallback_p2p.py``."""
