"""``python -m async_processor``: the same entry point as the ``async-processor`` script."""

from async_processor.cli.main import main

raise SystemExit(main())
