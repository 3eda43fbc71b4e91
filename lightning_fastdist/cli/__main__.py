"""``python -m lightning_fastdist.cli``: the ``lightning-fastdist`` command (Lightning's launcher starts the other
ranks as ``python -m lightning_fastdist.cli.__main__``, which runs it too)."""

from lightning_fastdist.cli import main

if __name__ == "__main__":
    main()
