"""Device meshes, logical-axis sharding rules, multi-host initialisation, global arrays."""
