from edgeserve.cli import main

raise SystemExit(main())
