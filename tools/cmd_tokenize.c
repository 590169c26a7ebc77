/* `shoal tokenize`: placeholder while the command is being written. */
#include <stdio.h>

#include "tools/cmd.h"

int sh__cmd_tokenize(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "error: shoal tokenize is not built yet\n");
    return 1;
}
