"""The non-finite step guard: a step whose loss or gradient norm is NaN or inf changes nothing,
and too many of them in a row stop the run with the last good state saved.

    guard = NonFiniteGuard(max_in_a_row=3)
    guard.update(step, result)          # after each step (result.skipped: it was non-finite)
    if guard.tripped:
        raise RunStopped(guard.message(save_checkpoint(...)))

train_step already left the weights and AdamW state untouched on such a step (loss and norm are
the same on every rank, so every rank skips together); this only counts. One bad step is usually
a bad batch and worth skipping; several in a row mean the run itself diverged (learning rate, data),
and continuing would only burn GPU hours, so the run stops and the message says how to go on.
"""

from __future__ import annotations


class RunStopped(RuntimeError):
    """The run cannot go on; what was good is saved and the message says how to continue."""


class NonFiniteGuard:
    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0  # non-finite steps ending at the last one
        self.total = 0  # non-finite steps of this launch
        self.last_step = 0
        self.last_loss = self.last_grad_norm = 0.0

    def update(self, step: int, result) -> None:
        """`step` is 1-based; `result` has .skipped, .loss and .grad_norm."""
        self.last_step, self.last_loss, self.last_grad_norm = step, result.loss, result.grad_norm
        if result.skipped:
            self.in_a_row += 1
            self.total += 1
        else:
            self.in_a_row = 0

    @property
    def tripped(self) -> bool:
        return self.in_a_row >= self.max_in_a_row

    def message(self, checkpoint_path: str) -> str:
        first_bad = self.last_step + 1 - self.in_a_row
        return (
            f"{self.in_a_row} non-finite steps in a row (steps {first_bad}-{self.last_step}, "
            f"last loss {self.last_loss}, grad_norm {self.last_grad_norm}); weights and optimizer "
            f"are those after step {first_bad - 1}, saved in {checkpoint_path}; lower --lr or "
            f"check the data, then continue with --resume auto"
        )
