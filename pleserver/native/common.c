/* The error record (see common.h). */
#include <stdarg.h>
#include <stdio.h>

#include "common.h"

void ple_error_set(ple_error *err, int kind, int code, const char *fmt, ...)
{
    if (err->kind != PLE_OK)
        return;
    err->kind = kind;
    err->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
}
