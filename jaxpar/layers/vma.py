"""shard_map's varying-axes types (check_vma), read and cast: what a custom_vjp's operands must agree on.

Its own module because both jaxpar.layers.collectives and jaxpar.layers.fp8 (which collectives imports) need it.
"""

from __future__ import annotations

import jax


def varying_of(aval) -> frozenset:
    """The manual mesh axes an abstract value is typed as differing over (check_vma); jax 0.10 keeps
    them in `manual_axis_type.varying`, later versions in `vma`."""
    vma = getattr(aval, "vma", None)
    if vma is None:
        axis_type = getattr(aval, "manual_axis_type", None)
        return frozenset(axis_type.varying if axis_type is not None else ())
    return frozenset(vma)


def typed_like(w: jax.Array, x: jax.Array) -> jax.Array:
    """`w` typed as varying over every manual axis `x` varies over, as einsum casts it implicitly (a custom_vjp
    must be handed it so: its weight gradient then has the weight's type, and JAX sums it outside)."""
    missing = tuple(sorted(varying_of(jax.typeof(x)) - varying_of(jax.typeof(w))))
    return jax.lax.pcast(w, missing, to="varying") if missing else w
