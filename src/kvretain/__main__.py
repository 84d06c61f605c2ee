from kvretain.cli import main

raise SystemExit(main())
