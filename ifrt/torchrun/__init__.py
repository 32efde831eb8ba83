"""torchrun's rendezvous on ifrt's coordinator (``torchrun --rdzv-backend ifrt``): the backend torch loads through its
``torchrun.handlers`` entry point (``backend``), and its state checked before torch unpickles it (``state``, which
reads a pickle's opcodes into inert values with ``opcodes``). Empty itself, so a module of it loads without torch."""
