"""Model math only: no meshes, no shardings; parallel hooks come in through `Collectives`."""
