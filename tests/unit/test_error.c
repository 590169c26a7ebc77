/* Unit tests of the error enum, sh_error helpers, version and file mapping. */
#include <stdio.h>
#include <unistd.h>

#include "base/error.h"
#include "base/file.h"
#include "sh_test.h"
#include "shoal.h"

static void test_strerror(void)
{
    for (int i = 0; i < SH_ERR_COUNT_; i++)
        CHECK(strcmp(sh_strerror((sh_err)i), "unknown error") != 0);
    CHECK_STR_EQ(sh_strerror((sh_err)9999), "unknown error");
    CHECK_STR_EQ(sh_strerror(SH_OK), "success");
}

static void test_error_set(void)
{
    sh_error e = {0};
    CHECK_INT_EQ(sh__error_set(&e, SH_EFORMAT, "bad %s %d", "magic", 7), SH_EFORMAT);
    CHECK_INT_EQ(e.code, SH_EFORMAT);
    CHECK_STR_EQ(e.msg, "bad magic 7");
    sh__error_prefix(&e, "f.gguf");
    CHECK_STR_EQ(e.msg, "f.gguf: bad magic 7");
    CHECK_INT_EQ(sh__error_set(NULL, SH_EIO, "ignored"), SH_EIO);
}

static void test_version(void) { CHECK_STR_EQ(sh_version(), SH_VERSION_STRING); }

static void test_file_map(void)
{
    char path[] = "/tmp/sh_test_fileXXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    CHECK_INT_EQ(write(fd, "hello", 5), 5);
    close(fd);
    sh_file_map m;
    sh_error e = {0};
    CHECK_OK(sh__file_map(path, 1, &m, &e));
    CHECK_UINT_EQ(m.size, 5);
    CHECK(m.data && memcmp(m.data, "hello", 5) == 0);
    sh__file_unmap(&m);
    CHECK(m.data == NULL);
    unlink(path);
    CHECK_INT_EQ(sh__file_map(path, 0, &m, &e), SH_EIO);
    CHECK(strstr(e.msg, "cannot open") != NULL);
    CHECK_INT_EQ(sh__file_map("/tmp", 0, &m, &e), SH_EINVAL);
}

static const sh_test_case tests[] = {
    {"strerror", test_strerror},
    {"error_set", test_error_set},
    {"version", test_version},
    {"file_map", test_file_map},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
