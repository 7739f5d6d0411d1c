from .cli import exit_process
from .main import main

exit_process(main())
