"""P/D disaggregation: everything about a prompt's KV moving from a prefill worker to a decode worker.

The wire records (kv_transfer_params, the handshake's answer) are contract:
`pdserve.api.kv_transfer`. Read in this order: `handshake` (who a prefill
worker is), `geometry` (which blocks travel), `peer_trust` (which hosts D may
contact), `connector` (the contract with the scheduler), `prefill` and
`decode` (the two sides, engine thread), `peers` (decode-side connections,
never waited on), `tickets` (D claims the pin's record from P and checks its
prompt: the only source of the block ids it reads and of the first token),
`ticket_inbox` (where a decode leg sent with its prefill leg waits for P's params),
`first_token` (whether D starts from P's first token), `admission` (async-side
checks before the engine sees a request), `leases` and `messages` (P's pins and D's notes to P),
`lending` (the lease discipline of whatever a worker lends: P's pins, and D's for peers), the
peer pull (a prefix from any worker, not only P to D: `peer_pins` on the holder (P or D), `peer_admission` and
`peer_pull` on the puller, `peer_costs` its measured decision; docs/architecture.md "A peer pull"), `wiring` (building it all for a worker).
Torch-free and nixl-free: pages move through `pdserve.transfer`.
May import: api, kv, transfer, request (the engine-thread record), metrics;
never engine (tests/test_import_rules.py).

Block lifetime on both sides (one request; time flows down):

    prefill worker (P)                                 decode worker (D)
    ------------------                                 -----------------
    prompt computed, first token sampled
    request_finished -> pin blocks, lease = now+L
    params {engine, epoch, pin id, nonce} --proxy--->  tickets: claim the pin (HTTP),
    ticket {block ids, prompt sha256, -------------->    own prompt's digest equal?
            first token (+ logprobs)}                    first_token: may D start from it?
                                                       admission: handshake, check
                                                       P's block ids, connect peer
                                                       request queued      (renew every H s)
    lease renewed <------------------ "renew" -------  scheduler allocates the whole prompt,
                                                       start_pull: READ of the blocks
    (pages must not change: still pinned)              READ in flight      (renew every H s)
    lease renewed <------------------ "renew" -------
    released -> scheduler frees <---- "done" --------  READ landed (every prompt token's KV) ->
                                                       P's token is output token 1 -> RUNNING
                                                       (first step: a decode step at position P)

    Where D may not start from P's token (a grammar, logprobs P did not record; pd/first_token.py) it
    computes the last prompt token itself from the pulled KV, counted by reason.
    A model with recurrent state: P ends a prefill chunk before the last prompt token and copies its
    live state page into a handoff page per state group, pinned with the blocks; D reads it into its
    live page (one page a group, whatever the prompt's length) and computes the last token from it
    (so state models stay on that path: first_token reason `recurrent_state`).

    D ends the request before reading:  "free" -> P releases at once
    D aborts during the READ:           D keeps its blocks until the READ ends, then frees them
    D never answers:                    P's lease runs out -> released -> freed
    READ fails or lands after half the lease: policy recompute (prefill on D) or fail (503 kv_pull_failed)
"""
