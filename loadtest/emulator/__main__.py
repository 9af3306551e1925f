from loadtest.emulator.cli import main

raise SystemExit(main())
