"""`POST /internal/kv/peer_pin` at the HTTP edge: token-guarded, a bounded and validated body, the
holder's answer as the ticket, 404 when it holds no block of the prefix, 503 while loading, and the
holder's typed refusals with their status."""

from __future__ import annotations

from fastapi.testclient import TestClient

from pdserve.api.kv_transfer import KVPinnedFull
from pdserve.api.peer_pull import PEER_PIN_PATH, PeerPinRefused, PeerPinTicket
from pdserve.metrics import create_metrics
from pdserve.server.app import create_internal_app
from pdserve.server.peer_routes import create_peer_pin_router

TICKET = PeerPinTicket(pin_id="peer-pin-1", engine_id="A", epoch="e", nonce="ab" * 16, num_tokens=16, block_size=16,
                       block_ids=[[3]], block_hashes=["00" * 32], lease_left_s=30.0)
TOKEN = {"X-Pdserve-Internal-Token": "t"}


def client_for(answer):
    asked: list[list[int]] = []

    def pin(token_ids: list[int]):
        asked.append(token_ids)
        if answer == "loading":
            return None

        async def pinning():
            if isinstance(answer, Exception):
                raise answer
            return answer
        return pinning()

    app = create_internal_app(create_metrics(), [create_peer_pin_router(pin, "t")])
    return TestClient(app), asked


def test_the_holder_answers_its_ticket_to_a_caller_with_the_token():
    client, asked = client_for(TICKET)
    with client:
        assert client.post(PEER_PIN_PATH, json={"token_ids": [1, 2, 3]}).status_code == 401
        assert asked == []  # nothing is pinned for a caller without the token
        response = client.post(PEER_PIN_PATH, json={"token_ids": [1, 2, 3]}, headers=TOKEN)
        assert response.status_code == 200 and PeerPinTicket.model_validate_json(response.content) == TICKET
        assert asked == [[1, 2, 3]]
        assert client.post(PEER_PIN_PATH, json={"token_ids": []}, headers=TOKEN).status_code == 400
        assert client.post(PEER_PIN_PATH, json={"token_ids": ["a"]}, headers=TOKEN).status_code == 400


def test_no_prefix_loading_and_refusals_answer_their_status():
    for answer, status in ((None, 404), ("loading", 503), (PeerPinRefused("no"), 409), (KVPinnedFull("full"), 503)):
        client, _ = client_for(answer)
        with client:
            assert client.post(PEER_PIN_PATH, json={"token_ids": [1]}, headers=TOKEN).status_code == status
