"""jaxpar: 3D-parallel (dp x pp x tp) training of LLMs and VLAs in JAX, with ZeRO-1/2/3 over dp."""

__version__ = "0.1.0"
