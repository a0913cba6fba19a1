#include "quant/quant.h"
