"""The test harness itself: what conftest.py skips on a machine without a GPU."""
import conftest


class FakeItem:
    """A collected test as conftest sees it: keywords, markers, added marks."""

    def __init__(self, keywords, marked):
        self.keywords = dict.fromkeys(keywords, 1)
        self.marked = marked
        self.added = []

    def get_closest_marker(self, name):
        return object() if self.marked and name == "gpu" else None

    def add_marker(self, mark):
        self.added.append(mark)


def test_without_a_gpu_only_gpu_marked_tests_are_skipped(monkeypatch):
    # every test under tests/gpu/ has "gpu" among its keywords (its folder's
    # name); the CPU checks of the GPU tools there must still run
    monkeypatch.setattr(conftest.gpu, "unavailable_reason", lambda: "cupy is not importable")
    marked = FakeItem(["test_kernels", "gpu"], marked=True)
    folder_only = FakeItem(["test_gpu_step_cpu_smoke", "gpu", "test_gpu_step_bench.py"],
                           marked=False)
    conftest.pytest_collection_modifyitems(None, [marked, folder_only])
    assert [m.kwargs["reason"] for m in marked.added] == ["no GPU: cupy is not importable"]
    assert folder_only.added == []


def test_with_a_gpu_nothing_is_skipped(monkeypatch):
    monkeypatch.setattr(conftest.gpu, "unavailable_reason", lambda: None)
    marked = FakeItem(["gpu"], marked=True)
    conftest.pytest_collection_modifyitems(None, [marked])
    assert marked.added == []
