from pretrieve.cli import main

raise SystemExit(main())
