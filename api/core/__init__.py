"""The engine core's process: the scheduling and model actors (`actors/`) wired over one model
runner (`engine_core.py`), and the process main (`process.py`) that serves requests sent by
`api/frontend/core_client.py` over ZMQ sockets. Also built inline, in the caller's process,
for tests and single-process use."""
