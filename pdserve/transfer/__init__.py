"""KV transfer: transport contract, NIXL agent, fake, descriptor planner. nixl is imported by nixl_transport only."""
