"""Training of the scorers: data, supervision target, boundary loss and the training loop (`KVPOP.md` Sec. 4-6)."""
