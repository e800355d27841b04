"""The engine: one thread that schedules every step and hands it to a runner, and its async face.

Torch-free (tests/test_import_hygiene.py): the model-running side is
`pdserve.runner`, which this package never imports; the loop sees it through
the `StepRunner` protocol of `step_runner`.

Read in this order. What the HTTP layer sees: `api` (the `EngineClient`
contract), `async_engine` (a `RequestStream` per request), `request_ids`.
The engine thread: `loop` (poll P/D -> schedule -> run -> update -> emit,
supervised), `step_runner` (what the loop asks of the runner), `scheduler`
with `schedule_types`, `step_budget` and `stop_rules` (every request-state
change and block allocation), `emitter` and `outputs` (text, stop strings,
sinks), `stats`, `core_share` (threads that follow a colocated peer's work).
Assembly lives in `pdserve.app` (the engine's builders).

May import: api, kv, transfer, request, pd, models (the tokenizer), metrics,
parallel (its torch-free `errors`). Never imports runner, server or app.
"""
