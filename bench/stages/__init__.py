"""Stamps of the time at each stage of a dense call, in the gateway (server.py) and in the client
(client.py), for bench/server_stages.py."""
