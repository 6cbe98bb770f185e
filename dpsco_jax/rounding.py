"""Certified floating-point bounds for the comparisons that privacy rests on.

A privacy proof reasons about exact quantities: "this example's gradient
norm is at most C", "these two points are within 2 tau". The library
computes them in float32 (or bfloat16 inputs promoted to float32), and a
computed value may sit on the wrong side of a threshold. Where the side
matters for privacy, the computed value is replaced by a bound that is
on the safe side whatever the rounding: a squared norm or distance is
raised to an UPPER bound of the exact value, a threshold is rounded DOWN.
Rounding can then only make a test stricter (clip a little earlier, count
a pair as close a little later), never looser.

The facts used (Higham, "Accuracy and Stability of Numerical Algorithms",
2nd ed., §2.2 and §4.2), with u the unit roundoff (2^-24 for float32):

* each operation rounds once: `fl(x op y) = (x op y)(1 + d)`, `|d| <= u` (no
  underflow); a difference is therefore accurate relative to ITSELF, not
  to its operands, which is what keeps distances far from the origin
  right (the Gram form `|a|^2 + |b|^2 - 2 a.b` is not);
* a sum of non-negative terms, each of which meets at most N roundings
  (whatever the order in which they are added), lies between
  `(1 - u)^N` and `(1 + u)^N` times the exact sum;
* an add of m terms in one XLA reduction costs each term at most m - 1
  roundings, whatever order XLA picks; so a length-n sum done as
  `ceil(n / c)` blocks of c (`blocked_sum_of_squares`, c = ceil(sqrt n))
  costs at most `c + ceil(n / c) - 2`, about 2 sqrt(n), instead of n - 1.

Underflow (squares below the smallest normal number, flushed to 0) is an
absolute error of at most `tiny` per term, covered by an additive floor.

References:
  N. J. Higham, Accuracy and Stability of Numerical Algorithms (SIAM,
  2002), Lemma 3.1 and §4.2; S. Casacuberta et al., "Widespread
  underestimation of sensitivity in differentially private libraries and
  how to fix it" (CCS 2022), for why float sums matter to privacy.
"""

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The unit roundoff of float32: the widest rounding any privacy-relevant
# computation here sees (bfloat16 and float16 inputs are converted to
# float32 exactly before they are combined).
FLOAT32_ROUNDOFF = 2.0 ** -24


def unit_roundoff(dtype: Any) -> float:
  """u of a floating dtype: half its machine epsilon.

  Example:
    >>> unit_roundoff(jnp.float32) == 2.0 ** -24
    True
  """
  return float(jnp.finfo(dtype).eps) / 2.0


def accumulation_dtype(*dtypes: Any) -> Any:
  """float32, or float64 when an input is float64 (x64 enabled)."""
  dtype = jnp.float32
  for other in dtypes:
    if jnp.issubdtype(other, jnp.floating):
      dtype = jnp.promote_types(dtype, other)
  return dtype


def block_width(size: int) -> int:
  """c = ceil(sqrt(size)), the block of `blocked_sum_of_squares`."""
  return max(1, math.isqrt(max(size - 1, 0)) + 1)


def sum_roundings(size: int) -> int:
  """Roundings a term meets in a two-level sum of `size` terms (at most)."""
  if size <= 3:
    return max(size - 1, 0)
  width = block_width(size)
  return width - 1 + (-(-size // width)) - 1


def gamma(n: Any, dtype: Any) -> Any:
  """`gamma_n = n u / (1 - n u)` (`n` an int or an array; inf past n u = 1/2).

  Example:
    >>> gamma(10, jnp.float32)   # about 10 * 2^-24
    5.96...e-07
  """
  nu = n * unit_roundoff(dtype)
  if isinstance(nu, float):
    return nu / (1.0 - nu) if nu < 0.5 else math.inf
  return jnp.where(nu < 0.5, nu / (1.0 - jnp.minimum(nu, 0.5)), jnp.inf)


def sum_in_two_levels(x: jax.Array) -> tuple[jax.Array, int]:
  """Sums `x` over its last axis in blocks of about sqrt(n) terms, then blocks.

  An optimization barrier separates the levels: without it XLA fuses the
  two reductions into one of n terms, and the bound below would not hold.

  Example:
    >>> sums, roundings = sum_in_two_levels(jnp.ones((2, 10)))
    >>> roundings   # (4 - 1) + (3 - 1)
    5

  Args:
    x: `[..., n]`.

  Returns:
    The sums `[...]` and the most rounded additions any term passes through,
    `sum_roundings(n)`, whatever order XLA adds each level in.
  """
  n = x.shape[-1]
  if n <= 3:
    return jnp.sum(x, axis=-1), max(n - 1, 0)
  width = block_width(n)
  rows = -(-n // width)
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, rows * width - n)])
  partial = jnp.sum(x.reshape(x.shape[:-1] + (rows, width)), axis=-1)
  partial = jax.lax.optimization_barrier(partial)
  return jnp.sum(partial, axis=-1), sum_roundings(n)


def blocked_sum_of_squares(x: jax.Array) -> jax.Array:
  """Sum of squares over the last axis, in two levels (`sum_in_two_levels`).

  Each term meets at most `1 + sum_roundings(n)` roundings (the square,
  this sum) whatever order XLA adds in (module docstring).

  Example:
    >>> blocked_sum_of_squares(jnp.ones((2, 10)))
    Array([10., 10.], dtype=float32)

  Args:
    x: `[..., n]` in the accumulation dtype.

  Returns:
    `[...]`.
  """
  return sum_in_two_levels(jnp.square(x))[0]


def squared_norm_roundings(leaf_sizes: Sequence[int],
                           extra: int = 0) -> int:
  """N for a squared norm summed per leaf (blocked) and then over leaves.

  One rounding for the square, `sum_roundings(n)` within the largest leaf,
  `L - 1` across the L leaves, plus `extra` roundings the caller's terms
  met before (a difference, a scaling).

  Example:
    >>> squared_norm_roundings([100])   # the square, 9 + 9 in the blocks
    19
  """
  worst = max(sum_roundings(size) for size in leaf_sizes)
  return 1 + worst + len(leaf_sizes) - 1 + extra


def upper_bound(computed: jax.Array, roundings: int, num_terms: int,
                dtype: Any) -> jax.Array:
  """An upper bound on an exact sum of non-negative terms from its float value.

  With every term through at most N = `roundings` roundings, the exact sum
  is at most `computed / (1 - u)^N + n tiny`; this returns
  `computed (1 + 2 (N + 3) u) + 4 n tiny`, which stays above that even
  after its own two roundings (for (N + 3) u <= 1/4).

  Example:
    >>> upper_bound(jnp.float32(1.0), roundings=10, num_terms=5,
    ...             dtype=jnp.float32)   # 1 + 26 u

  Args:
    computed: the float sum (non-negative).
    roundings: N.
    num_terms: n, for the underflow floor.
    dtype: the dtype it was computed in.

  Returns:
    The bound, in `dtype` (inf stays inf).

  Raises:
    ValueError: if N u is too large for the bound to mean anything.
  """
  roundoff = unit_roundoff(dtype)
  if (roundings + 3) * roundoff > 0.25:
    raise ValueError(f'{roundings} roundings in {np.dtype(dtype).name} leave '
                     'no usable error bound')
  factor = 1.0 + 2.0 * (roundings + 3) * roundoff
  floor = 4.0 * num_terms * float(jnp.finfo(dtype).tiny)
  return computed * jnp.asarray(factor, dtype) + jnp.asarray(floor, dtype)


def square_below(radius: Any, dtype: Any) -> jax.Array:
  """A value of `dtype` that is at most radius^2 (a threshold rounded down).

  Example:
    >>> float(square_below(0.1, jnp.float32)) <= 0.1 ** 2
    True
  """
  if isinstance(radius, (int, float, np.floating, np.integer)):
    exact = float(radius) ** 2
    value = np.asarray(exact, dtype)
    if float(value) > exact:
      value = np.nextafter(value, np.asarray(0, dtype))
    return jnp.asarray(value)
  radius = jnp.asarray(radius, dtype)
  return radius * radius * (1.0 - 4.0 * unit_roundoff(dtype))


def pairwise_sum(x: jax.Array) -> jax.Array:
  """Sum over axis 0 as a balanced tree: ceil(log2 K) roundings per term.

  Each level adds two slices (one rounding), so the bound does not depend
  on the order XLA would pick inside a single reduction.

  Example:
    >>> pairwise_sum(jnp.arange(5.0))
    Array(10., dtype=float32)
  """
  while x.shape[0] > 1:
    if x.shape[0] % 2:
      x = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])
    x = x[0::2] + x[1::2]
  return x[0]


def pairwise_roundings(size: int) -> int:
  """Roundings a term meets in `pairwise_sum` of `size` terms: ceil(log2 n).

  Example:
    >>> pairwise_roundings(5)
    3
  """
  return max(size - 1, 0).bit_length()


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(fl(a + b), e)` with `fl(a + b) + e = a + b` EXACTLY (Knuth's TwoSum).

  Exact in round to nearest barring overflow: six additions, no
  multiplication (so no fused multiply-add can change it), and XLA does
  not reassociate float additions.
  """
  total = a + b
  virtual = total - a
  return total, (a - (total - virtual)) + (b - virtual)


def compensated_pairwise_sum(x: jax.Array) -> jax.Array:
  """Sum over axis 0 as a balanced tree, with every addition's error kept.

  Each level adds pairs with `_two_sum`; its exact errors are carried down
  the tree beside the sums (two roundings per level for them), and the
  total is `sums + errors`, rounded once. With L = ceil(log2 n) levels the
  error is at most `u (1 + 2.2 L^2 u) sum_i |x_i|` (the errors' own sum is
  off by `gamma_2L` of `sum |e| <= u L (1 + u)^L sum |x_i|`; the last
  rounding adds `u sum |x_i|`): at most `gamma_2` for L <= 2^11
  (`compensated_sum_roundings`), whatever n, where a plain pairwise sum
  costs `gamma_L` and a running sum `gamma_(n - 1)`.

  Example:
    >>> compensated_pairwise_sum(jnp.array([2.0 ** 24, 1.0, 1.0, 0.0]))
    Array(16777218., dtype=float32)

  Args:
    x: `[n, ...]`.

  Returns:
    `[...]`.
  """
  errors = jnp.zeros_like(x)
  while x.shape[0] > 1:
    if x.shape[0] % 2:
      pad = jnp.zeros((1,) + x.shape[1:], x.dtype)
      x, errors = jnp.concatenate([x, pad]), jnp.concatenate([errors, pad])
    x, error = _two_sum(x[0::2], x[1::2])
    errors = errors[0::2] + errors[1::2] + error
  return x[0] + errors[0]


def compensated_sum_roundings(size: int) -> int:
  """The roundings-equivalent N of `compensated_pairwise_sum` of `size` terms.

  `u (1 + 2.2 L^2 u) <= gamma_N` with `N = 1 + ceil(2.2 L^2 u)`, L the
  levels: 2 for any realistic size (0 for one term).

  Example:
    >>> compensated_sum_roundings(10 ** 6)
    2
  """
  if size <= 1:
    return 0
  levels = pairwise_roundings(size)
  return 1 + math.ceil(2.2 * levels ** 2 * FLOAT32_ROUNDOFF)


def weighted_row_sum(weights: jax.Array, rows: jax.Array
                     ) -> tuple[jax.Array, int]:
  """`sum_i weights[i] rows[i]` over axis 0, in a fixed, compensated order.

  Each product is one rounded elementwise multiply and the products are
  added by `compensated_pairwise_sum`, so every term meets at most
  `1 + compensated_sum_roundings(n)` roundings whatever the backend: no
  matrix product is involved, so neither the order of a matmul's
  accumulation nor a reduced matmul precision (TF32 on NVIDIA GPUs,
  bfloat16 passes on TPUs) changes what is released.

  Example:
    >>> total, roundings = weighted_row_sum(jnp.array([1.0, 0.5]),
    ...                                     jnp.ones((2, 3)))
    >>> total, roundings
    (Array([1.5, 1.5, 1.5], dtype=float32), 3)

  Args:
    weights: `[n]`.
    rows: `[n, ...]`, in the accumulation dtype.

  Returns:
    The sum `[...]` and the roundings N a term meets.
  """
  products = rows * weights.reshape((-1,) + (1,) * (rows.ndim - 1)).astype(
      rows.dtype)
  return (compensated_pairwise_sum(products),
          1 + compensated_sum_roundings(rows.shape[0]))


def compensated_add(total: jax.Array, compensation: jax.Array,
                    x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One step of compensated accumulation: `(total + x, compensation + error)`.

  `_two_sum` gives the rounding error of `total + x` exactly, and the
  errors are summed apart. After K steps, `total + compensation` (one more rounding)
  is within `(u + 1.01 K^2 u^2) sum_k |x_k|` of the exact sum for K u <=
  2^-8: about 2u, independent of K, where a running sum costs up to
  (K - 1) u (`accumulation_roundings`).

  Example:
    >>> total, comp = compensated_add(jnp.float32(2.0 ** 24), jnp.float32(0),
    ...                               jnp.float32(1.0))
    >>> float(total) + float(comp)
    16777217.0

  Args:
    total: the running sum.
    compensation: the running sum of its rounding errors.
    x: the next term.

  Returns:
    The new `(total, compensation)`.
  """
  new_total, error = _two_sum(total, x)
  return new_total, compensation + error


def accumulation_roundings(num_steps: int) -> int:
  """The roundings-equivalent N of `compensated_add` over `num_steps` terms.

  The error of the compensated sum plus the final `total + compensation`
  is at most `u (2 + 1.02 K^2 u) sum_k |x_k|` (K = `num_steps`, K u <=
  2^-8; see `compensated_add`), and `gamma_N >= N u`, so
  `N = 2 + ceil(1.02 K^2 u)`: 3 up to 4,000 steps.

  Example:
    >>> accumulation_roundings(100)
    3

  Raises:
    ValueError: past 2^16 steps, where the bound's conditions fail.
  """
  if num_steps <= 1:
    return 0
  if num_steps > 2 ** 16:
    raise ValueError(f'{num_steps} accumulation steps leave no usable error '
                     'bound: use larger blocks')
  return 2 + math.ceil(1.02 * num_steps ** 2 * FLOAT32_ROUNDOFF)


def sum_clip_shrink(num_terms: int, roundings: int, dtype: Any,
                    num_devices: int = 1) -> float:
  """The factor a clip is shrunk by so that a ROUNDED sum keeps its sensitivity.

  A float sum of n contributions, each through at most N roundings, is
  within `gamma_N sum_i |x_i|` of the exact sum in every coordinate, so
  within `gamma_N sum_i ||x_i||_2 <= gamma_N n C'` in l2 when each
  contribution's norm is at most C' (Higham Lemma 3.1). Two neighbouring
  batches' computed sums then differ by at most `f C' + 2 gamma_N n C'`
  (f >= 1 the neighbouring relation's factor), which is at most f C when
  `C' = C / (1 + 2 gamma_N n)`: this returns `1 / (1 + 2 gamma_N n)`. The
  sensitivity stays `f C`, as accounted; contributions are clipped that
  much harder (3.7e-4 at n = 1024 with `weighted_row_sum` alone, N = 3;
  5.9e-3 at n = 16384). Without it, adversarial contributions summed in a running
  order move the sum of one neighbour by more than the clip (Casacuberta
  et al. 2022; `tests/test_precision.py`).

  Summed over P devices. Each device sums its own n rows as above, then
  the P sums are added across the devices (`psum`), in an order that is
  the backend's: each device's sum meets at most P - 1 roundings there, so
  the total moves by at most `gamma_(P-1) sum_p |S_p|` per coordinate, at
  most `gamma_(P-1) (1 + gamma_N) n P C'` in l2 (Higham Lemma 3.1 again).
  Two neighbouring batches differ on one device: the other devices'
  computed sums are the same numbers in both and cancel, so the two totals
  differ by at most `f C' + 2 gamma_N n C' + 2 gamma_(P-1) (1 + gamma_N)
  n P C'`, and the clip is shrunk by one over 1 plus the last two terms.

  Example:
    >>> 1 - sum_clip_shrink(1024, 3, jnp.float32)   # about 3.7e-4
    0.00036...
    >>> 1 - sum_clip_shrink(128, 7, jnp.float32, num_devices=8)  # 9.6e-4
    0.00096...

  Args:
    num_terms: n, the rows summed (padding included), on each device.
    roundings: N.
    dtype: the accumulation dtype.
    num_devices: P, the devices whose sums are added (1: no cross-device
      sum).

  Returns:
    The shrink factor, in (0, 1].

  Raises:
    ValueError: when the bound leaves less than half the clip.
  """
  num_devices = int(num_devices)
  margin = 2.0 * gamma(roundings, dtype) * num_terms
  if num_devices > 1:
    margin += (2.0 * gamma(num_devices - 1, dtype) *
               (1.0 + gamma(roundings, dtype)) * num_terms * num_devices)
  if not margin <= 1.0:
    raise ValueError(
        f'summing {num_terms} contributions'
        + (f' (on each of {num_devices} devices)' if num_devices > 1 else '')
        + f' with {roundings} roundings each '
        f'in {np.dtype(dtype).name} could move the sum by more than the clip '
        f'(bound {margin:.3g}): use '
        + ('fewer examples or fewer devices per sum' if num_devices > 1
           else 'smaller microbatches or a wider dtype'))
  return 1.0 / (1.0 + margin)


def float32_values(values: Any) -> np.ndarray:
  """The float64 array of `values` as the device holds them, in float32.

  Coefficients that a mechanism casts to float32 for the device (a BLT's
  decays and scales) define the linear map the device really applies; the
  accountant must read those, not the float64 values they were rounded
  from. Near a decay of 1 the difference matters: at T = 10^6 steps,
  decays `1 - 1.4 * 2^-24` rounded to float32 raise the sensitivity by
  1.2% (`tests/test_precision.py`).

  Example:
    >>> float32_values([0.1])[0] == float(np.float32(0.1))
    True

  Args:
    values: an array-like of floats.

  Returns:
    float64 values, each exactly representable in float32.
  """
  return np.asarray(np.asarray(values, np.float64).astype(np.float32),
                    np.float64)
