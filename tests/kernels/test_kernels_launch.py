"""FastLaunch's cache: one JIT launch per specialisation, then the compiled handle, on CPU.

Triton's runtime is replaced by a recording double (no GPU here); the GPU tests run the real one
(tests/cuda/test_cuda_kernels.py::test_fast_launch_repeats_and_new_specialisations_stay_correct)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import phalanx.kernels.launch as launch


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, *args: object) -> None:
        self.log.append(("fast", args))


class _Kernel:
    """Parameters (x_ptr, n, BLOCK: constexpr), like a @triton.jit function's."""

    params = [SimpleNamespace(num=0, is_constexpr=False), SimpleNamespace(num=1, is_constexpr=False),
              SimpleNamespace(num=2, is_constexpr=True)]  # fmt: skip

    def __init__(self) -> None:
        self.log: list = []

    def __getitem__(self, grid: tuple) -> object:
        def jit(*args: object, **options: object) -> _Compiled:
            self.log.append(("jit", grid, args, options))
            return _Compiled(self.log)

        return jit


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> _Kernel:
    monkeypatch.setattr(launch, "_INTERPRET", False)
    driver = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234)
    monkeypatch.setattr(launch.triton.runtime, "driver", SimpleNamespace(active=driver))
    return _Kernel()


def test_same_specialisation_launches_the_compiled_handle(kernel: _Kernel) -> None:
    fast = launch.FastLaunch(kernel)
    x = torch.zeros(64)
    fast((3,), x, 7, 128, num_warps=4)
    fast((5, 2), x, 9, 128, num_warps=4)  # 7 and 9: same integer class
    assert [entry[0] for entry in kernel.log] == ["jit", "fast"]
    assert kernel.log[1][1] == (5, 2, 1, 1234, "fn", "meta", None, None, None, x, 9, 128)


@pytest.mark.parametrize(
    "change",
    [
        "misaligned pointer",
        "integer divisible by 16",
        "integer one",
        "constexpr value",
        "launch option",
        "dtype",
    ],
)
def test_a_new_specialisation_goes_through_the_jit(kernel: _Kernel, change: str) -> None:
    fast = launch.FastLaunch(kernel)
    x = torch.zeros(64)
    fast((1,), x, 7, 128, num_warps=4)
    args, options = {
        "misaligned pointer": ((x[1:], 7, 128), {"num_warps": 4}),
        "integer divisible by 16": ((x, 32, 128), {"num_warps": 4}),
        "integer one": ((x, 1, 128), {"num_warps": 4}),
        "constexpr value": ((x, 7, 256), {"num_warps": 4}),
        "launch option": ((x, 7, 128), {"num_warps": 8}),
        "dtype": ((x.half(), 7, 128), {"num_warps": 4}),
    }[change]
    fast((1,), *args, **options)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"], change


@pytest.mark.parametrize(
    "changed",
    [(7.5, "a float where the first launch had an integer"), (None, "None where it had an integer")],
)
def test_an_argument_of_another_kind_takes_the_general_key(
    kernel: _Kernel, changed: tuple[object, str]
) -> None:
    """The fast key is generated from the first launch's argument kinds; an argument of another
    kind must fall back to the general key (a JIT launch), and never reuse the first binary."""
    value, what = changed
    fast = launch.FastLaunch(kernel)
    x = torch.zeros(64)
    fast((1,), x, 7, 128, num_warps=4)
    fast((1,), x, value, 128, num_warps=4)
    fast((1,), x, value, 128, num_warps=4)  # the general key caches that specialisation too
    fast((1,), x, 9, 128, num_warps=4)  # and the first kind still takes the fast key
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "fast", "fast"], what
    assert kernel.log[1][2][1] is value


def test_a_tensor_where_the_first_launch_had_an_integer_is_a_new_specialisation(kernel: _Kernel) -> None:
    fast = launch.FastLaunch(kernel)
    x = torch.zeros(64)
    fast((1,), x, 7, 128, num_warps=4)
    fast((1,), x, torch.tensor(7), 128, num_warps=4)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"]


def test_an_optional_tensor_left_out_then_given_is_another_specialisation(kernel: _Kernel) -> None:
    fast = launch.FastLaunch(kernel)
    x = torch.zeros(64)
    fast((1,), None, 7, 128, num_warps=4)
    fast((1,), x, 7, 128, num_warps=4)  # a tensor where None was: the general key, not a per-tensor one
    fast((1,), torch.zeros(64), 7, 128, num_warps=4)
    fast((1,), None, 7, 128, num_warps=4)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "fast", "fast"]
    assert len(fast._compiled) == 2


def test_a_constexpr_before_runtime_parameters_is_keyed_by_value(kernel: _Kernel) -> None:
    """(BLOCK: constexpr, x_ptr, n): the key tests each position instead of splitting the tail."""
    kernel.params = [SimpleNamespace(num=0, is_constexpr=True), SimpleNamespace(num=1, is_constexpr=False),
                     SimpleNamespace(num=2, is_constexpr=False)]  # fmt: skip
    fast = launch.FastLaunch(kernel)
    x = torch.zeros(64)
    fast((1,), 128, x, 7)
    fast((1,), 128, x, 9)
    fast((1,), 256, x, 7)
    assert [entry[0] for entry in kernel.log] == ["jit", "fast", "jit"]


def test_a_binding_launches_the_compiled_handle_with_the_call_s_tensors_in_place(kernel: _Kernel) -> None:
    fast = launch.FastLaunch(kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    fast((3,), x, 7, 128, num_warps=4)
    bound = fast.bind((3,), (x, 7, 128), (x,), num_warps=4)
    bound(y)
    assert [entry[0] for entry in kernel.log] == ["jit", "fast"]
    assert kernel.log[1][1] == (3, 1, 1, 1234, "fn", "meta", None, None, None, y, 7, 128)
    assert kernel.log[1][1][9] is y


def test_one_tensor_may_stand_in_several_places(kernel: _Kernel) -> None:
    kernel.params = [SimpleNamespace(num=i, is_constexpr=False) for i in range(3)]
    fast = launch.FastLaunch(kernel)
    x, y = torch.zeros(64), torch.zeros(64)
    fast((1,), x, 5, x)
    fast.bind((1,), (x, 5, x), (x,))(y)
    assert kernel.log[1][0] == "fast" and kernel.log[1][1][9:] == (y, 5, y)


@pytest.mark.parametrize("change", ["dtype", "misaligned pointer"])
def test_a_per_call_tensor_of_another_specialisation_takes_the_general_launch(
    kernel: _Kernel, change: str
) -> None:
    fast = launch.FastLaunch(kernel)
    x = torch.zeros(64)
    fast((1,), x, 7, 128, num_warps=4)
    bound = fast.bind((1,), (x, 7, 128), (x,), num_warps=4)
    bound(x.half() if change == "dtype" else x[1:])
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"], change


def test_a_binding_before_any_launch_takes_the_general_launch(kernel: _Kernel) -> None:
    fast = launch.FastLaunch(kernel)
    x = torch.zeros(64)
    bound = fast.bind((1,), (x, 7, 128), (x,), num_warps=4)
    bound(x)
    bound(x)
    assert [entry[0] for entry in kernel.log] == ["jit", "fast"]


def test_a_binding_keeps_no_per_call_tensor_alive(kernel: _Kernel) -> None:
    import gc
    import weakref

    fast = launch.FastLaunch(kernel)
    x = torch.zeros(64)
    fast((1,), x, 7, 128, num_warps=4)
    bound = fast.bind((1,), (x, 7, 128), (x,), num_warps=4)
    kernel.log.clear()
    seen = weakref.ref(x)
    del x
    gc.collect()
    assert seen() is None
    bound(torch.zeros(64))
    assert [entry[0] for entry in kernel.log] == ["fast"]


def test_next_pow2_and_cdiv_match_triton() -> None:
    import triton

    assert [launch.next_pow2(n) for n in range(1, 300)] == [triton.next_power_of_2(n) for n in range(1, 300)]
    assert [launch.cdiv(a, 7) for a in range(0, 50)] == [triton.cdiv(a, 7) for a in range(0, 50)]
