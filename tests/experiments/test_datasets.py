"""Tests of `experiments.datasets`."""

import gzip
import os
import pickle
import struct
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import datasets


def test_digits_shapes_and_dtypes():
  train, test = datasets.load_digits()
  assert train['x'].shape == (1437, 64) and test['x'].shape == (360, 64)
  assert train['y'].shape == (1437,) and test['y'].shape == (360,)
  for split in (train, test):
    assert split['x'].dtype == np.float32
    assert split['y'].dtype == np.int32


def test_digits_pixels_scaled_to_unit_interval():
  train, test = datasets.load_digits()
  pixels = np.concatenate([train['x'], test['x']])
  assert pixels.min() == 0.0 and pixels.max() == 1.0
  # Scaled by the maximum intensity 16, not per image: 1/16 steps remain.
  np.testing.assert_array_equal(pixels * 16, np.round(pixels * 16))


def test_digits_split_is_stratified():
  train, test = datasets.load_digits()
  train_counts = np.bincount(train['y'], minlength=10)
  test_counts = np.bincount(test['y'], minlength=10)
  np.testing.assert_allclose(test_counts / (train_counts + test_counts), 0.2,
                             atol=0.02)


def test_digits_split_is_deterministic_and_seeded():
  first_train, first_test = datasets.load_digits(seed=0)
  again_train, again_test = datasets.load_digits(seed=0)
  np.testing.assert_array_equal(first_train['x'], again_train['x'])
  np.testing.assert_array_equal(first_test['y'], again_test['y'])
  other_train, _ = datasets.load_digits(seed=1)
  assert not np.array_equal(first_train['x'], other_train['x'])


def _rows(split):
  """Each example (pixels and label) as bytes, to compare splits as sets."""
  return {x.tobytes() + y.tobytes() for x, y in zip(split['x'], split['y'])}


def test_digits_split_is_disjoint_and_complete():
  # The 1,797 digits are pairwise distinct, so set sizes count examples.
  train, test = datasets.load_digits(test_fraction=0.25)
  train_rows, test_rows = _rows(train), _rows(test)
  assert len(train_rows) == len(train['y']) and len(test_rows) == len(test['y'])
  assert not train_rows & test_rows
  assert len(train_rows | test_rows) == 1797


@pytest.mark.parametrize('test_fraction', [0.0, 1.0, -0.1])
def test_digits_rejects_bad_fraction(test_fraction):
  with pytest.raises(ValueError, match='test_fraction'):
    datasets.load_digits(test_fraction=test_fraction)


# ------------------------------------------------------------ IDX / MNIST.

FASHION_MNIST = '/usr/share/datasets/fashion-mnist'
IDX_STEMS = ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte',
             't10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte')


def write_idx(path, array, gz, magic=None):
  """Writes `array` (uint8) as an IDX file; `magic` overrides the header's."""
  array = np.asarray(array, np.uint8)
  if magic is None:
    magic = 0x0800 + array.ndim
  data = struct.pack('>I', magic) + struct.pack(
      f'>{array.ndim}I', *array.shape) + array.tobytes()
  with open(path, 'wb') as f:
    f.write(gzip.compress(data) if gz else data)


def idx_contents(seed=0):
  """Small train/test images (4x3 pixels) and labels with known values."""
  rng = np.random.default_rng(seed)
  images = {'train': rng.integers(0, 256, (5, 4, 3), dtype=np.uint8),
            'test': rng.integers(0, 256, (2, 4, 3), dtype=np.uint8)}
  images['train'][0, 0, 0], images['train'][0, 0, 1] = 0, 255
  labels = {'train': np.array([0, 9, 3, 3, 1], np.uint8),
            'test': np.array([7, 2], np.uint8)}
  return images, labels


def write_idx_dir(directory, gz, dotted=False):
  images, labels = idx_contents()
  arrays = (images['train'], labels['train'], images['test'], labels['test'])
  for stem, array in zip(IDX_STEMS, arrays):
    name = stem.replace('-idx', '.idx') if dotted else stem
    write_idx(os.path.join(directory, name + ('.gz' if gz else '')), array,
              gz)
  return images, labels


def check_images(split, images, labels):
  n = len(labels)
  assert split['x'].shape == (n, images[0].size)
  assert split['x'].dtype == np.float32 and split['y'].dtype == np.int32
  np.testing.assert_array_equal(split['x'],
                                images.reshape(n, -1).astype(np.float32) / 255)
  np.testing.assert_array_equal(split['y'], labels)


@pytest.mark.parametrize('gz', [True, False])
@pytest.mark.parametrize('loader', [datasets.load_fashion_mnist,
                                    datasets.load_mnist])
def test_idx_loaders_return_file_contents(tmp_path, gz, loader):
  images, labels = write_idx_dir(str(tmp_path), gz)
  train, test = loader(str(tmp_path))
  check_images(train, images['train'], labels['train'])
  check_images(test, images['test'], labels['test'])
  assert train['x'].min() == 0.0 and train['x'].max() == 1.0


def test_idx_files_with_dotted_names(tmp_path):
  images, labels = write_idx_dir(str(tmp_path), gz=False, dotted=True)
  train, _ = datasets.load_mnist(str(tmp_path))
  check_images(train, images['train'], labels['train'])


def test_read_idx_tells_gzip_by_content_not_name(tmp_path):
  path = str(tmp_path / 'labels')
  write_idx(path, [1, 2, 3], gz=True)
  np.testing.assert_array_equal(datasets.read_idx(path, ndim=1), [1, 2, 3])


def test_fashion_mnist_missing_folder_says_how_to_get_it(tmp_path):
  with pytest.raises(FileNotFoundError,
                     match='apt-get install dataset-fashion-mnist'):
    datasets.load_fashion_mnist(str(tmp_path / 'absent'))


def test_idx_missing_file_is_named(tmp_path):
  write_idx_dir(str(tmp_path), gz=True)
  os.remove(tmp_path / 't10k-labels-idx1-ubyte.gz')
  with pytest.raises(FileNotFoundError, match='t10k-labels-idx1-ubyte'):
    datasets.load_fashion_mnist(str(tmp_path))


@pytest.mark.parametrize('stem,magic,expected', [
    ('train-images-idx3-ubyte', 0x0801, '0x00000803'),   # labels' magic
    ('train-images-idx3-ubyte', 0x0903, '0x00000803'),   # not unsigned bytes
    ('t10k-labels-idx1-ubyte', 0x01000801, '0x00000801'),  # nonzero head
])
def test_idx_bad_magic_number(tmp_path, stem, magic, expected):
  images, labels = write_idx_dir(str(tmp_path), gz=False)
  array = images['train'] if stem.startswith('train') else labels['test']
  write_idx(str(tmp_path / stem), array, gz=False, magic=magic)
  with pytest.raises(ValueError, match=f'bad IDX magic number 0x{magic:08x}, '
                     f'expected {expected}'):
    datasets.load_mnist(str(tmp_path))


def test_idx_truncated_file(tmp_path):
  write_idx_dir(str(tmp_path), gz=False)
  path = tmp_path / 'train-images-idx3-ubyte'
  path.write_bytes(path.read_bytes()[:-1])
  with pytest.raises(ValueError, match=r'shape \(5, 4, 3\).*truncated'):
    datasets.load_mnist(str(tmp_path))


def test_idx_image_label_count_mismatch(tmp_path):
  write_idx_dir(str(tmp_path), gz=True)
  write_idx(str(tmp_path / 't10k-labels-idx1-ubyte.gz'), [1, 2, 3], gz=True)
  with pytest.raises(ValueError, match='2 images but .* 3 labels'):
    datasets.load_mnist(str(tmp_path))


def test_idx_corrupt_gzip(tmp_path):
  write_idx_dir(str(tmp_path), gz=True)
  path = tmp_path / 'train-images-idx3-ubyte.gz'
  path.write_bytes(path.read_bytes()[:20])
  with pytest.raises(ValueError, match='corrupt gzip'):
    datasets.load_mnist(str(tmp_path))


def write_npz(path, **overrides):
  images, labels = idx_contents()
  arrays = {'x_train': images['train'], 'y_train': labels['train'],
            'x_test': images['test'], 'y_test': labels['test']}
  arrays.update(overrides)
  np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
  return images, labels


@pytest.mark.parametrize('as_folder', [False, True])
def test_mnist_npz(tmp_path, as_folder):
  images, labels = write_npz(str(tmp_path / 'mnist.npz'))
  train, test = datasets.load_mnist(
      str(tmp_path) if as_folder else str(tmp_path / 'mnist.npz'))
  check_images(train, images['train'], labels['train'])
  check_images(test, images['test'], labels['test'])


def test_mnist_npz_bad_layout(tmp_path):
  write_npz(str(tmp_path / 'a.npz'), y_test=None)
  with pytest.raises(ValueError, match=r"lacks arrays \['y_test'\]"):
    datasets.load_mnist(str(tmp_path / 'a.npz'))
  write_npz(str(tmp_path / 'b.npz'), x_train=np.zeros((5, 4, 3), np.float32))
  with pytest.raises(ValueError, match='uint8'):
    datasets.load_mnist(str(tmp_path / 'b.npz'))
  (tmp_path / 'c.npz').write_bytes(b'not a zip file')
  with pytest.raises(ValueError, match='not a readable .npz'):
    datasets.load_mnist(str(tmp_path / 'c.npz'))


def test_mnist_missing_says_how_to_get_it(tmp_path):
  with pytest.raises(FileNotFoundError, match='mnist.npz.*data_path'):
    datasets.load_mnist(str(tmp_path / 'absent'))
  with pytest.raises(FileNotFoundError, match='train-images-idx3-ubyte'):
    datasets.load_mnist(str(tmp_path))   # an empty folder


@pytest.mark.skipif(not os.path.isdir(FASHION_MNIST),
                    reason=f'{FASHION_MNIST} absent (apt-get install '
                    'dataset-fashion-mnist)')
def test_real_fashion_mnist():
  train, test = datasets.load_fashion_mnist()
  assert train['x'].shape == (60000, 784) and test['x'].shape == (10000, 784)
  assert train['x'].dtype == np.float32 and test['y'].dtype == np.int32
  assert train['x'].min() == 0.0 and train['x'].max() == 1.0
  for split, n in ((train, 6000), (test, 1000)):
    np.testing.assert_array_equal(np.bincount(split['y']), [n] * 10)


# ------------------------------------------------------------------ CIFAR-10.


def write_cifar(directory, protocol=pickle.HIGHEST_PROTOCOL, sizes=None):
  """Six batches of random images; returns (train, test) data and labels."""
  rng = np.random.default_rng(1)
  names = [f'data_batch_{i}' for i in range(1, 6)] + ['test_batch']
  sizes = sizes or [3, 2, 1, 2, 3, 4]
  written = []
  os.makedirs(directory, exist_ok=True)
  for name, n in zip(names, sizes):
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = [int(v) for v in rng.integers(0, 10, n)]
    with open(os.path.join(directory, name), 'wb') as f:
      pickle.dump({b'batch_label': name.encode(), b'data': data,
                   b'labels': labels,
                   b'filenames': [b'x.png'] * n}, f, protocol=protocol)
    written.append((data, np.array(labels)))
  train = tuple(np.concatenate(parts) for parts in zip(*written[:5]))
  return train, written[5]


@pytest.mark.parametrize('protocol', [2, pickle.HIGHEST_PROTOCOL])
def test_cifar10_returns_batches_in_order(tmp_path, protocol):
  folder = str(tmp_path / 'cifar-10-batches-py')
  (train_x, train_y), (test_x, test_y) = write_cifar(folder, protocol)
  # The folder itself, or its parent, as extracted from the archive.
  for path in (folder, str(tmp_path)):
    train, test = datasets.load_cifar10(path)
    check_images(train, train_x, train_y)
    check_images(test, test_x, test_y)
  assert train['x'].shape == (11, 3072)


def test_cifar10_channels_last(tmp_path):
  (train_x, _), _ = write_cifar(str(tmp_path))
  train, _ = datasets.load_cifar10(str(tmp_path), channels_last=True)
  hwc = train_x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  np.testing.assert_array_equal(train['x'].reshape(-1, 32, 32, 3),
                                hwc.astype(np.float32) / 255)
  # The red value of pixel (0, 1) is the file's second byte.
  assert train['x'][0, 3] == train_x[0, 1] / np.float32(255)


def test_cifar10_missing_says_how_to_get_it(tmp_path):
  with pytest.raises(FileNotFoundError, match='cifar-10-python.tar.gz'):
    datasets.load_cifar10(str(tmp_path / 'absent'))
  write_cifar(str(tmp_path))
  os.remove(tmp_path / 'test_batch')
  with pytest.raises(FileNotFoundError, match='test_batch'):
    datasets.load_cifar10(str(tmp_path))


def test_cifar10_refuses_foreign_pickles_and_bad_shapes(tmp_path):
  write_cifar(str(tmp_path))
  with open(tmp_path / 'data_batch_2', 'wb') as f:
    pickle.dump({b'data': os.getcwd, b'labels': []}, f)
  with pytest.raises(ValueError, match='refusing to load'):
    datasets.load_cifar10(str(tmp_path))
  with open(tmp_path / 'data_batch_2', 'wb') as f:
    pickle.dump({b'data': np.zeros((2, 3071), np.uint8), b'labels': [1, 2]},
                f)
  with pytest.raises(ValueError, match=r'uint8 \[n, 3072\]'):
    datasets.load_cifar10(str(tmp_path))


# ------------------------------------------------------- tensorflow_datasets.


def test_tfds_absent_says_how_to_get_it(monkeypatch):
  # None in sys.modules makes the import fail even where TFDS is installed.
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)
  with pytest.raises(ImportError, match='pip install .*tensorflow-datasets'):
    datasets.load_tfds('mnist')


def fake_tfds(prepared):
  """A stand-in `tensorflow_datasets` holding one prepared 'toy' data set."""
  images = np.arange(2 * 2 * 2 * 1, dtype=np.uint8).reshape(2, 2, 2, 1) * 30
  calls = []

  def load(name, split, data_dir, download, batch_size, as_supervised):
    calls.append(dict(name=name, split=split, data_dir=data_dir,
                      download=download, batch_size=batch_size,
                      as_supervised=as_supervised))
    if not prepared:
      raise AssertionError(f'Dataset {name} not found in {data_dir}')
    return [(images, np.array([1, 0])), (images[:1], np.array([5]))]

  module = types.ModuleType('tensorflow_datasets')
  module.load, module.as_numpy = load, lambda tree: tree
  return module, images, calls


def test_tfds_loads_prepared_data_without_downloading(monkeypatch):
  module, images, calls = fake_tfds(prepared=True)
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', module)
  train, test = datasets.load('tfds:toy', '/data/tfds')
  check_images(train, images, [1, 0])
  check_images(test, images[:1], [5])
  assert calls == [dict(name='toy', split=['train', 'test'],
                        data_dir='/data/tfds', download=False, batch_size=-1,
                        as_supervised=True)]


def test_tfds_unprepared_data_says_how_to_get_it(monkeypatch):
  module, _, _ = fake_tfds(prepared=False)
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', module)
  with pytest.raises(FileNotFoundError, match='tfds build toy'):
    datasets.load_tfds('toy')


# ------------------------------------------------ Synthetic convex problems.


def mean_and_error(losses):
  """The mean and 5 standard errors of a sample of losses."""
  return losses.mean(), 5 * losses.std() / np.sqrt(len(losses))


@pytest.mark.parametrize('kind,features,condition_number', [
    ('linear_regression', 'gaussian', 1.0),
    ('linear_regression', 'sphere', 1.0),
    ('logistic', 'gaussian', 1.0),
    ('linear_regression', 'gaussian', 100.0),
    ('linear_regression', 'sphere', 100.0)])
def test_synthetic_empirical_risk_matches_population_risk(kind, features,
                                                          condition_number):
  problem = datasets.synthetic_convex(kind, num_train=200000, num_test=10,
                                      dim=5, optimum_norm=2.0, noise_std=0.5,
                                      features=features,
                                      condition_number=condition_number,
                                      seed=3)
  assert problem.train['x'].shape == (200000, 5)
  assert problem.train['x'].dtype == np.float32
  assert problem.train['y'].dtype == (np.float32 if kind == 'linear_regression'
                                      else np.int32)
  rng = np.random.default_rng(0)
  per_example = jax.jit(jax.vmap(problem.loss, (None, 0)))
  for w in (problem.optimum, problem.optimum + 0.7 * rng.normal(size=5),
            np.zeros(5)):
    losses = np.asarray(per_example(jnp.asarray(w, jnp.float32),
                                    problem.train), np.float64)
    mean, error = mean_and_error(losses)
    # 1e-6: the JAX losses are float32.
    assert abs(mean - problem.population_risk(w)) < error + 1e-6
    assert abs(problem.empirical_risk(w, problem.train) - mean) < 1e-4


def test_synthetic_linear_regression_closed_form():
  problem = datasets.synthetic_convex('linear_regression', num_train=10,
                                      dim=4, optimum_norm=3.0, noise_std=0.2)
  assert np.linalg.norm(problem.optimum) == pytest.approx(3.0)
  assert problem.optimal_risk == pytest.approx(0.5 * 0.2**2)
  w = problem.optimum + np.array([1.0, 0.0, -2.0, 0.0])
  assert problem.population_risk(w) == pytest.approx(0.5 * (5.0 + 0.04))


@pytest.mark.parametrize('kind', ['linear_regression', 'logistic'])
def test_synthetic_optimum_minimizes_population_risk(kind):
  problem = datasets.synthetic_convex(kind, num_train=10, dim=4,
                                      optimum_norm=1.5, seed=2)
  np.testing.assert_allclose(problem.population_gradient(problem.optimum), 0,
                             atol=1e-12)
  rng = np.random.default_rng(1)
  for _ in range(10):
    w = problem.optimum + 0.3 * rng.normal(size=4)
    assert problem.population_risk(w) > problem.optimal_risk
    # The gradient is the derivative of the risk (central differences).
    eps = 1e-5
    numeric = [(problem.population_risk(w + eps * e)
                - problem.population_risk(w - eps * e)) / (2 * eps)
               for e in np.eye(4)]
    np.testing.assert_allclose(problem.population_gradient(w), numeric,
                               atol=1e-7)


def assert_minimizes_over_ball(problem, point, radius, num_points):
  """No point drawn uniformly in the ball has a lower population risk."""
  rng = np.random.default_rng(0)
  points = rng.normal(size=(num_points, problem.dim))
  points *= radius * rng.random((num_points, 1))**(1 / problem.dim) / (
      np.linalg.norm(points, axis=1, keepdims=True))
  best = problem.population_risk(point)
  assert all(problem.population_risk(w) >= best for w in points)


@pytest.mark.parametrize('kind', ['linear_regression', 'logistic'])
def test_synthetic_constrained_optimum(kind):
  problem = datasets.synthetic_convex(kind, num_train=10, dim=3,
                                      optimum_norm=2.0, seed=4)
  np.testing.assert_array_equal(problem.constrained_optimum(3.0),
                                problem.optimum)
  on_ball = problem.constrained_optimum(0.5)
  np.testing.assert_allclose(on_ball, problem.optimum / 4)
  assert_minimizes_over_ball(problem, on_ball, 0.5, 200)
  # KKT: minus the gradient is an outward normal of the ball.
  gradient = problem.population_gradient(on_ball)
  np.testing.assert_allclose(np.cross(gradient, on_ball), 0, atol=1e-12)
  assert gradient @ on_ball < 0
  with pytest.raises(ValueError, match='radius'):
    problem.constrained_optimum(0.0)


def test_synthetic_sphere_features_are_bounded_and_isotropic():
  problem = datasets.synthetic_convex(num_train=50000, dim=4,
                                      features='sphere')
  x = problem.train['x'].astype(np.float64)
  np.testing.assert_allclose(np.linalg.norm(x, axis=1), 2.0, rtol=1e-6)
  np.testing.assert_allclose(x.T @ x / len(x), np.eye(4), atol=0.03)


@pytest.mark.parametrize('features', ['gaussian', 'sphere'])
def test_anisotropic_regression_has_its_spectrum(features):
  problem = datasets.synthetic_convex(num_train=200000, num_test=0, dim=5,
                                      optimum_norm=2.0, features=features,
                                      condition_number=100.0, seed=6)
  spectrum = problem.spectrum
  assert spectrum.max() / spectrum.min() == pytest.approx(100.0)
  assert spectrum.mean() == pytest.approx(1.0)
  x = problem.train['x'].astype(np.float64)
  np.testing.assert_allclose(x.T @ x / len(x), np.diag(spectrum),
                             atol=0.02 * spectrum.max())
  if features == 'sphere':   # bounded: ||x||^2 <= d max(Lambda)
    assert np.max(np.sum(x**2, 1)) <= 5 * spectrum.max() * (1 + 1e-6)


def test_anisotropic_constrained_optimum_meets_kkt_and_beats_the_ball():
  problem = datasets.synthetic_convex(num_train=10, dim=4, optimum_norm=2.0,
                                      condition_number=300.0, seed=7)
  on_ball = problem.constrained_optimum(0.5)
  assert np.linalg.norm(on_ball) == pytest.approx(0.5, rel=1e-12)
  # Not the radial projection any more: the flat directions give way first.
  assert not np.allclose(on_ball, problem.optimum / 4, atol=1e-3)
  gradient = problem.population_gradient(on_ball)
  multiplier = -(gradient @ on_ball) / (on_ball @ on_ball)
  assert multiplier > 0
  np.testing.assert_allclose(gradient + multiplier * on_ball, 0, atol=1e-12)
  assert_minimizes_over_ball(problem, on_ball, 0.5, 2000)
  with pytest.raises(ValueError, match='condition_number'):
    datasets.synthetic_convex(condition_number=0.5)
  with pytest.raises(ValueError, match='isotropic'):
    datasets.synthetic_convex('logistic', condition_number=10.0)


def test_synthetic_is_seeded_and_validates():
  first = datasets.synthetic_convex('logistic', num_train=50, seed=5)
  again = datasets.synthetic_convex('logistic', num_train=50, seed=5)
  np.testing.assert_array_equal(first.train['x'], again.train['x'])
  np.testing.assert_array_equal(first.optimum, again.optimum)
  assert set(np.unique(first.train['y'])) <= {0, 1}
  with pytest.raises(ValueError, match='kind'):
    datasets.synthetic_convex('hinge')
  with pytest.raises(ValueError, match='gaussian'):
    datasets.synthetic_convex('logistic', features='sphere')


# ------------------------------------------------------------------ Registry.


def test_registry_by_name_and_path(tmp_path):
  train, _ = datasets.load('digits', seed=1)
  np.testing.assert_array_equal(train['x'],
                                datasets.load_digits(seed=1)[0]['x'])
  images, labels = write_idx_dir(str(tmp_path), gz=True)
  for name in ('fashion_mnist', 'mnist'):
    train, _ = datasets.load(name, str(tmp_path))
    check_images(train, images['train'], labels['train'])
  (train_x, train_y), _ = write_cifar(str(tmp_path / 'cifar'))
  train, _ = datasets.load('cifar10', str(tmp_path / 'cifar'))
  check_images(train, train_x, train_y)
  train, test = datasets.load('synthetic_logistic', num_train=7, num_test=3,
                              dim=2)
  assert train['x'].shape == (7, 2) and test['y'].shape == (3,)


def test_registry_tabular(tmp_path):
  rows = ['AT,AP,AH,AFDP,GTEP,TIT,TAT,TEY,CDP,CO,NOX']
  rows += [','.join(str(i * 10 + j + (i * j) % 3) for j in range(11))
           for i in range(10)]
  (tmp_path / 'gt_2011.csv').write_text('\n'.join(rows) + '\n')
  train, test = datasets.load('gas_turbine', str(tmp_path), seed=1,
                              test_fraction=0.3)
  assert train['x'].shape == (7, 9) and test['x'].shape == (3, 9)
  assert train['y'].dtype == np.float32
  with pytest.raises(ValueError, match='housing.csv'):
    datasets.load('california_housing')


def test_registry_errors(tmp_path):
  with pytest.raises(ValueError, match='unknown data set .*fashion_mnist'):
    datasets.load('imagenet')
  with pytest.raises(ValueError, match='not read from a path'):
    datasets.load('digits', str(tmp_path))
  with pytest.raises(ValueError, match='data_path.*mnist.npz'):
    datasets.load('mnist')
  with pytest.raises(ValueError, match='data_path.*cifar-10-python'):
    datasets.load('cifar10')
