"""Serving policies to robots over the network: ``python -m embodied_jax.serve CKPT_DIR``.

``server.py`` owns the websocket policy server (openpi's protocol, batching, named errors),
``client.py`` a client for robot code and tests, ``wire.py`` the msgpack-numpy encoding.
"""
