/* `shoal mkmodel`: placeholder while the command is being written. */
#include <stdio.h>

#include "tools/cmd.h"

int sh__cmd_mkmodel(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "error: shoal mkmodel is not built yet\n");
    return 1;
}
