"""Stand-ins for what cannot exist on a test machine (a kubelet, an API server, a GPU).

Each behaves like the real thing over the real protocol (a Unix socket, HTTP);
tests use them instead of mocks.
"""
