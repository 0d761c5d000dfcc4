"""Training of the scorers: data, supervision target, boundary loss and the training loop (`docs/method.md` Sec. 4-6)."""
