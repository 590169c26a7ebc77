/* The smallest Shoal host: prints the version of the library it runs with. It proves that a
 * program builds against an installed Shoal (its Makefile through pkg-config, its CMakeLists.txt
 * through find_package(Shoal)) and runs with the installed libshoal.so. */
#include <shoal.h>

#include <stdio.h>

int main(void)
{
    /* sh_version() is the library's; SH_VERSION_STRING is the header's this program was built
     * with. They differ when the program runs with another release of libshoal.so. */
    printf("shoal %s (built with the %s header, API version %d)\n", sh_version(), SH_VERSION_STRING,
           SH_API_VERSION);
    printf("%s: %s\n", "SH_EINVAL", sh_strerror(SH_EINVAL));
    return 0;
}
