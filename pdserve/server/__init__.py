"""HTTP layer of a worker: the OpenAI API, health and metrics, built by `pdserve.server.app.create_app`."""
