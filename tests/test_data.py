"""Data: real files in ../shared/data, IDX parsing, preprocessing, splits and the generator."""

from __future__ import annotations

import gzip
import itertools
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ssdcore.data import (
    DATA_DIR_ENV,
    as_data_tensor,
    default_data_dir,
    load_frey_face,
    load_mnist,
    preprocess,
    split,
    synthetic_rbm_data,
    synthetic_rbm_model,
)

# From the data directory's README.md.
MNIST_TEST_CLASS_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
MNIST_FIRST_LABELS = [7, 2, 1, 0, 4, 1, 4, 9, 5, 9, 0, 6]
SHARED = default_data_dir()
needs_shared_data = pytest.mark.skipif(
    not (SHARED / "mnist").is_dir(), reason=f"real data directory {SHARED} is not present"
)


@pytest.fixture(autouse=True)
def _single_thread():
    # Tiny tensors: one thread avoids OpenMP hand-offs, which dominate on busy 2-core machines.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def mnist_with_labels():
    return load_mnist(with_labels=True)


def write_idx(directory: Path, stem: str, images: np.ndarray, labels: np.ndarray, gz: bool):
    """Write a small IDX image/label pair, compressed or not."""
    opener = gzip.open if gz else open
    suffix = ".gz" if gz else ""
    with opener(directory / f"{stem}-images-idx3-ubyte{suffix}", "wb") as handle:
        handle.write(struct.pack(">iiii", 2051, len(images), 28, 28) + images.tobytes())
    with opener(directory / f"{stem}-labels-idx1-ubyte{suffix}", "wb") as handle:
        handle.write(struct.pack(">ii", 2049, len(labels)) + labels.tobytes())


@needs_shared_data
def test_default_data_dir_is_shared_data_next_to_the_repository():
    repository = Path(__file__).resolve().parents[1]
    assert default_data_dir() == repository.parent / "shared" / "data"


def test_data_dir_can_be_overridden(monkeypatch, tmp_path):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert default_data_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match="SSDRBM_DATA_DIR"):
        load_mnist()


@needs_shared_data
def test_mnist_test_set_loads_with_known_labels(mnist_with_labels):
    images, labels = mnist_with_labels
    assert images.shape == (10000, 784) and images.dtype == torch.float32
    assert float(images.min()) == 0.0 and float(images.max()) == 255.0
    assert labels.dtype == torch.int64
    assert torch.bincount(labels).tolist() == MNIST_TEST_CLASS_COUNTS
    assert labels[:12].tolist() == MNIST_FIRST_LABELS
    assert torch.equal(load_mnist(subset="test"), images)
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load_mnist(subset="train")


@needs_shared_data
def test_mnist_reads_uncompressed_files_and_both_subsets(tmp_path, mnist_with_labels):
    images, labels = mnist_with_labels
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        with gzip.open(SHARED / "mnist" / f"{name}.gz") as src, open(tmp_path / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    plain_images, plain_labels = load_mnist(tmp_path, with_labels=True)
    assert torch.equal(plain_images, images) and torch.equal(plain_labels, labels)
    train_images = np.arange(3 * 784, dtype=np.uint8).reshape(3, 28, 28)
    write_idx(tmp_path, "train", train_images, np.array([3, 1, 4], dtype=np.uint8), gz=True)
    both, both_labels = load_mnist(tmp_path, with_labels=True)
    assert both.shape == (10003, 784)
    assert torch.equal(both[:3], torch.from_numpy(train_images.reshape(3, 784)).float())
    assert both_labels[:3].tolist() == [3, 1, 4] and torch.equal(both_labels[3:], labels)


def test_mnist_rejects_corrupt_files(tmp_path):
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(struct.pack(">iiii", 1234, 1, 28, 28))
    with pytest.raises(ValueError, match="not an IDX image file"):
        load_mnist(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(struct.pack(">iiii", 2051, 5, 28, 28) + b"x")
    with pytest.raises(ValueError, match="truncated"):
        load_mnist(tmp_path)


@needs_shared_data
def test_frey_face_loads_as_upright_images():
    faces = load_frey_face()
    assert faces.shape == (1965, 560) and faces.dtype == torch.float32
    assert float(faces.min()) == 8.0 and float(faces.max()) == 238.0
    images = faces.reshape(-1, 28, 20)
    # Upright: the transposed reading would not put the row-major pixel order back; check that
    # neighbouring pixels within a row are more alike than 20 apart (the next row down).
    within_row = (images[:, :, 1:] - images[:, :, :-1]).abs().mean()
    scrambled = faces.reshape(-1, 20, 28)
    across = (scrambled[:, :, 1:] - scrambled[:, :, :-1]).abs().mean()
    assert within_row < across


def test_frey_face_missing_file_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"frey_rawface\.mat"):
        load_frey_face(tmp_path / "nothing.mat")


def test_preprocess_modes():
    x = torch.tensor([[0.0, 255.0, 100.0], [50.0, 200.0, 100.0], [10.0, 128.0, 100.0]])
    assert torch.equal(preprocess(x, "none"), x)
    scaled = preprocess(x, "scale")
    assert float(scaled.min()) == 0.0 and float(scaled.max()) == 1.0
    binary = preprocess(x, "binarize")
    assert torch.equal(binary, (x / 255 > 0.5).float())
    standard = preprocess(x, "standardize")
    torch.testing.assert_close(standard[:, :2].mean(0), torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(standard[:, :2].std(0, unbiased=False), torch.ones(2))
    assert torch.equal(standard[:, 2], torch.zeros(3))  # a constant feature becomes 0
    with pytest.raises(ValueError, match="binarize"):
        preprocess(x, "whiten")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_data_is_rejected_with_its_position(bad):
    x = np.zeros((4, 3), dtype=np.float32)
    x[2, 1] = bad
    with pytest.raises(ValueError, match=r"NaN/Inf value\(s\), the first at index \(2, 1\)"):
        as_data_tensor(x, "data")
    with pytest.raises(ValueError, match="NaN/Inf"):
        preprocess(torch.from_numpy(x), "scale")


def test_arrays_are_flattened_to_float32_rows():
    images = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    x = as_data_tensor(images)
    assert x.shape == (2, 12) and x.dtype == torch.float32
    with pytest.raises(ValueError, match="examples, features"):
        as_data_tensor(np.zeros(5))
    with pytest.raises(ValueError, match="numeric"):
        as_data_tensor(np.array([["a", "b"]]))


def test_split_is_seeded_disjoint_and_complete():
    x = torch.arange(100.0).reshape(50, 2)
    train, valid = split(x, 0.2, seed=4)
    assert train.shape == (40, 2) and valid.shape == (10, 2)
    rows = torch.cat([train, valid])[:, 0].sort().values
    assert torch.equal(rows, x[:, 0])
    again_train, _ = split(x, 0.2, seed=4)
    assert torch.equal(train, again_train)
    assert not torch.equal(train, split(x, 0.2, seed=5)[0])
    with pytest.raises(ValueError, match="valid_fraction"):
        split(x, 1.0)


def test_synthetic_model_follows_the_paper():
    model = synthetic_rbm_model(100, 25, seed=0)
    assert model.W.detach().var().item() == pytest.approx(0.5, rel=0.1)
    assert not model.b.detach().any() and not model.a.detach().any()


def test_synthetic_data_is_binary_seeded_and_matches_the_model():
    n_hidden = 8
    data = synthetic_rbm_data(n_visible=30, n_hidden=n_hidden, n_samples=4000, seed=2)
    assert data.shape == (4000, 30) and data.dtype == torch.float32
    assert set(data.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(data, synthetic_rbm_data(30, n_hidden, 4000, seed=2))
    assert not torch.equal(data, synthetic_rbm_data(30, n_hidden, 4000, seed=3))
    # E[v] under the generating model, by enumerating h: Σ_h p(h) σ(Wh + b).
    model = synthetic_rbm_model(30, n_hidden, seed=2)
    W = model.W.detach().double()
    h = torch.tensor(list(itertools.product([0.0, 1.0], repeat=n_hidden)), dtype=torch.float64)
    p_h = torch.softmax(F.softplus(h @ W.t()).sum(1), 0)
    expected = p_h @ torch.sigmoid(h @ W.t())
    # Standard error of each mean ≤ 0.008; allow 5 of them (30 units).
    torch.testing.assert_close(data.double().mean(0), expected, atol=0.04, rtol=0)
    gibbs = synthetic_rbm_data(30, n_hidden, 4000, seed=2, method="gibbs", gibbs_sweeps=100)
    torch.testing.assert_close(gibbs.double().mean(0), expected, atol=0.04, rtol=0)
    with pytest.raises(ValueError, match="method='gibbs'"):
        synthetic_rbm_data(10, 21, 5, method="exact")
