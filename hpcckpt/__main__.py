from hpcckpt.cli import main

raise SystemExit(main())
