"""Which BLAS serves MLX: the answer must not be fooled by numpy's bundled OpenBLAS."""


def test_blas_detection_ignores_numpy_bundled_openblas(monkeypatch):
    from omlx.kernels import blas

    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.setattr(blas, "_loaded_libraries", lambda: [
        "/venv/lib/python3.11/site-packages/numpy.libs/libscipy_openblas64_-ff651d7f.so",
        "/venv/lib/python3.11/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0",
    ])
    st = blas.detect_blas()
    assert st.name == "reference" and not st.fast and "numpy.libs" not in (st.path or "")
