from reinforge.cli import main

raise SystemExit(main())
