/* `shoal inspect`: placeholder while the command is being written. */
#include <stdio.h>

#include "tools/cmd.h"

int sh__cmd_inspect(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "error: shoal inspect is not built yet\n");
    return 1;
}
